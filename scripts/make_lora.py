#!/usr/bin/env python
"""Write a PEFT LoRA adapter for a base model we serve (default: the embedded SmolLM2-135M),
with ``peft`` itself, so the engine reads exactly what users bring.

Random (``--rank``, ``--targets``, ``--alpha``, ``--rslora``): B is drawn too (PEFT starts it at
zero, which would change nothing), scaled so the adapter moves the logits visibly. Trained
(``--train-text FILE --seconds 60``): a minute of next-token training on a small text from the
random start's shape (B at zero, as PEFT starts), so that the adapter's effect shows in what
the model writes (it leans toward the text).

    python scripts/make_lora.py --out /tmp/lora-r16 --rank 16
    python scripts/make_lora.py --out tests/data/smollm2-lora-r4 --rank 4 --targets q_proj,v_proj \\
        --train-text README.md --seconds 60 --save-dtype float16
    asyncengine serve --lora mine=/tmp/lora-r16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from asyncengine.script_main import run_main

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_model(model: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF model of a name or path the engine serves (the embedded GGUF converted once)."""
    from transformers import AutoModelForCausalLM

    from asyncengine.executor.loader.default_model import resolve_model

    directory = resolve_model(model, dtype)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def random_adapter(
    model: torch.nn.Module,
    out: Path,
    rank: int,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    alpha: float | None = None,
    rslora: bool = False,
    seed: int = 0,
    b_scale: float = 0.5,
    save_dtype: torch.dtype = torch.float32,
) -> Path:
    """A rank-``rank`` adapter with random A and B on ``targets`` of ``model`` (left untouched:
    the adapter is wrapped around it, then removed), saved in PEFT's format under ``out``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    generator = torch.Generator().manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan = param.shape[1]
                noise = torch.randn(param.shape, generator=generator) / fan**0.5
                param.copy_(noise * (b_scale if "lora_B" in name else 1.0))
    _save(peft_model, out, save_dtype)
    peft_model.unload()  # the base modules back as they were
    return out


def trained_adapter(
    model: torch.nn.Module,
    tokenizer_dir: Path,
    text: str,
    out: Path,
    rank: int,
    targets: Sequence[str],
    seconds: float,
    seed: int = 0,
    save_dtype: torch.dtype = torch.float32,
    lr: float = 1e-2,
) -> tuple[Path, float, float, int]:
    """Train a LoRA on ``text`` (next-token loss, windows of 64 tokens) for ``seconds``; returns
    the directory, the loss before and after, and the steps taken."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer

    torch.manual_seed(seed)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(text).ids)
    window = 64
    count = max(1, (len(ids) - 1) // window)
    windows = ids[: count * window + 1]
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0, bias="none"
    )
    peft_model = get_peft_model(model, config)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    first = last = float("nan")
    started = time.perf_counter()
    step = 0
    while time.perf_counter() - started < seconds:
        picks = torch.randint(0, count, (2,))
        batch = torch.stack([windows[i * window : i * window + window + 1] for i in picks])
        loss = peft_model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        last = float(loss.detach())
        first = last if step == 0 else first
        step += 1
    peft_model.eval()
    _save(peft_model, out, save_dtype)
    return out, first, last, step


def _save(peft_model: torch.nn.Module, out: Path, save_dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if save_dtype != torch.float32:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(save_dtype)
    peft_model.save_pretrained(str(out))  # type: ignore[operator]
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model card


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the adapter directory to write")
    parser.add_argument("--model", default="smollm2-135m", help="the base (name or HF dir)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2 x rank)")
    parser.add_argument("--rslora", action="store_true", help="alpha / sqrt(rank) scaling")
    parser.add_argument(
        "--targets", default="q_proj,v_proj", help=f"comma-separated, of {','.join(ALL_TARGETS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-text", type=Path, help="train on this text instead of random")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument(
        "--save-dtype", choices=("float32", "float16", "bfloat16"), default="float32"
    )
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(ALL_TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}: choose from {', '.join(ALL_TARGETS)}")
    save_dtype = getattr(torch, args.save_dtype)
    model = base_model(args.model)
    if args.train_text is not None:
        from asyncengine.executor.loader.default_model import tokenizer_dir

        _, before, after, steps = trained_adapter(
            model,
            tokenizer_dir(args.model),
            args.train_text.read_text(),
            args.out,
            args.rank,
            targets,
            args.seconds,
            args.seed,
            save_dtype,
            args.lr,
        )
        print(f"trained {steps} steps: loss {before:.3f} -> {after:.3f}")
    else:
        random_adapter(
            model, args.out, args.rank, targets, args.alpha, args.rslora, args.seed,
            save_dtype=save_dtype,
        )  # fmt: skip
    print(args.out)


if __name__ == "__main__":
    run_main(main)
