#!/usr/bin/env python
"""Our engine serves the GGUFs llama.cpp's converter made for the peer (scripts/setup_llamacpp.sh:
the embedded model's float32 HF directory converted to f32 and bf16 GGUFs) as the same model.

For each converted file: every tensor our GGUF loader reads equals the HF directory's (exactly
for f32; within bfloat16's rounding for bf16, which is what that file stores), the tokenizer
read from the GGUF's metadata encodes a few texts as the directory's does, and greedy
continuations (EOS ignored) of a few prompts through ``AsyncEngine`` on the GGUF equal those on
the HF directory token for token (f32), or agree for the reported share (bf16: other weights).
Exits 1 when an f32 check fails. setup_llamacpp.sh runs it after converting.

    .venv/bin/python scripts/peers/llamacpp/check_gguf.py                  # both files, 3 prompts x 24
    .venv/bin/python scripts/peers/llamacpp/check_gguf.py --kinds float32 --tokens 48
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # scripts/: the peers package

import torch

from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.loader import (
    DEFAULT_MODEL,
    load_weights,
    read_gguf,
    resolve_model,
    tokenizer_dir,
)
from asyncengine.script_main import run_main
from asyncengine.text.tokenizer import Tokenizer
from peers.llamacpp import launcher as peer_llamacpp

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea.",
)


def compare_weights(gguf: Path, model_dir: Path, exact: bool) -> dict[str, Any]:
    """Max |difference| over every tensor; tensors missing on either side are listed."""
    ours = read_gguf(gguf, torch.float32).weights
    reference = dict(load_weights(model_dir, torch.float32))
    if "lm_head.weight" not in ours:  # tied: the GGUF has no output.weight
        reference.pop("lm_head.weight", None)
    missing = sorted(set(reference) ^ set(ours))
    worst = 0.0
    for name in sorted(set(reference) & set(ours)):
        want = reference[name] if exact else reference[name].to(torch.bfloat16).float()
        got = ours[name]
        assert isinstance(got, torch.Tensor)
        worst = max(worst, float((got - want).abs().max()))
    return {"tensors": len(ours), "mismatched_names": missing, "max_abs_diff": worst}


def compare_tokenizers(gguf_model_dir: Path, model_dir: Path) -> bool:
    ours, reference = Tokenizer(gguf_model_dir), Tokenizer(model_dir)
    return all(ours.encode(text) == reference.encode(text) for text in PROMPTS)


async def greedy(model: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from asyncengine.api.engine import AsyncEngine

    config = EngineConfig.from_toml(None, model=model, dtype="float32", log_interval=0.0)
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        outs = [await engine.generate(prompt, params) for prompt in prompts]
    return [list(out.token_ids) for out in outs]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    model_dir = resolve_model(DEFAULT_MODEL, torch.float32)
    reference_tokenizer = Tokenizer(model_dir)
    prompts = [reference_tokenizer.encode(text) for text in PROMPTS]
    reference = asyncio.run(greedy(str(model_dir), prompts, args.tokens))
    failed = False
    for kind in args.kinds:
        gguf = peer_llamacpp.model_file(kind)
        exact = kind == "float32"
        weights = compare_weights(gguf, model_dir, exact)
        same_tokenizer = compare_tokenizers(tokenizer_dir(gguf), model_dir)
        got = asyncio.run(greedy(str(gguf), prompts, args.tokens))
        agreed = [agreeing_prefix(a, b) for a, b in zip(got, reference, strict=True)]
        print(
            f"{kind} ({gguf.name}): {weights['tensors']} tensors, max |diff| vs the HF dir "
            f"{weights['max_abs_diff']:.3g}{'' if exact else ' (after rounding it to bf16)'}, "
            f"names differing: {weights['mismatched_names'] or 'none'}; tokenizer "
            f"{'same' if same_tokenizer else 'DIFFERS'}; greedy tokens agreeing "
            f"{sum(agreed)}/{len(agreed) * args.tokens} ({agreed})"
        )
        ok = (
            weights["max_abs_diff"] == 0.0
            and not weights["mismatched_names"]
            and same_tokenizer
            and got == reference
        )
        if exact and not ok:
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
