"""Accuracy of an int8 K/V pool (``kv_cache_dtype = "int8"``) on the embedded model, beside the
pools it replaces: float32 (the reference) and a 16-bit one.

    python scripts/kv_int8_accuracy.py [--tokens 4096] [--dtype bfloat16] [--json out.json]

``--dtype float32`` (the default): float32 activations over float32, float16 and int8 pools;
``--dtype bfloat16``: the model in bfloat16 (what ``dtype = "auto"`` picks on AVX-512 BF16
CPUs) over its own bfloat16 pool and over int8, against the float32 model and pool.

The weights are the same in every variant, so only the pool differs: ``--weights gguf`` (the
default) the file's as stored (Q4_1 projections on the native kernels, which also quantize the
activations to int8 blocks: any small change then turns into another rounding now and then),
``--weights dense`` the same dequantized to float32 (the pool's own error alone). Two measures:

- perplexity over a fixed long text, teacher-forced in prefill chunks of ``--chunk`` tokens
  (so every chunk after the first reads its prefix from the pool: the extend kernel's int8
  path over thousands of keys). The text is this repository's own docs (docs/ARCHITECTURE.md
  then docs/KERNELS.md, written for it, so the model has not seen them), its first
  ``--tokens`` tokens; the JSON records their sha256 so runs on other commits can be compared;
- greedy agreement on unseen prompts: continuations of ``--prompts`` windows of that text
  (each ``--context`` tokens long, at spread offsets: long-context decodes on the fused step)
  plus a few short questions, token by token against each other pool, counted up to the
  first difference.

Target: perplexity within 0.5% of the 16-bit pool's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncengine.cache.page_table import PageTable  # noqa: E402
from asyncengine.common.plan import BatchPlan, Segment  # noqa: E402
from asyncengine.executor.kv_pool import KVPool  # noqa: E402
from asyncengine.executor.layers.model_config import ModelConfig  # noqa: E402
from asyncengine.executor.loader import read_gguf  # noqa: E402
from asyncengine.executor.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS, metadata_dir  # noqa: E402
from asyncengine.executor.loader.gguf_loader import Weight  # noqa: E402
from asyncengine.executor.runner import ModelRunner  # noqa: E402
from asyncengine.kernels.quant_formats import GGUF_FORMATS  # noqa: E402
from asyncengine.text.tokenizer import Tokenizer  # noqa: E402

TEXT_FILES = ("docs/ARCHITECTURE.md", "docs/KERNELS.md")
SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three things to pack for a hike are",
    "Water boils at",
]
PAGE_SIZE = 16
F32, BF16 = torch.float32, torch.bfloat16
# --dtype -> each pool's name -> (the model's dtype, the pool's); the first is the reference,
# the second the 16-bit pool int8 is held against
POOLS = {
    "float32": {"float32": (F32, F32), "float16": (F32, torch.float16), "int8": (F32, torch.int8)},
    "bfloat16": {"float32": (F32, F32), "bfloat16": (BF16, BF16), "int8": (BF16, torch.int8)},
}
PPL_TARGET = 0.005  # int8 within 0.5% of the 16-bit pool
WEIGHTS = {
    "gguf": "GGUF as stored (Q4_1)",
    "dense": "GGUF dequantized to float32",
}


@dataclass(slots=True)
class PoolResult:
    kv_cache_dtype: str
    perplexity: float
    activations: str
    perplexity_vs_float32: float  # ratio - 1
    perplexity_vs_16bit: float  # against float16, or bfloat16 for --dtype bfloat16
    greedy_agreeing_float32: int  # tokens equal to that pool's before the first difference
    greedy_agreeing_16bit: int
    greedy_total: int


class Runner:
    """The model in ``dtype`` over a fresh pool of ``kv_dtype``, one sequence at a time (page-table
    row 0)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        max_len: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        pages = -(-max_len // PAGE_SIZE)
        pool = KVPool.for_model(config, pages, PAGE_SIZE, kv_dtype)
        self.runner = ModelRunner(config, weights, pool, PageTable.contiguous(1, pages), dtype)

    def chunk_logits(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [len(tokens), vocab] of tokens at positions start.. (the pool holds 0..start)."""
        plan = BatchPlan(step=1, extends=[Segment("t", 0, tokens, start, True)])
        runner = self.runner
        with torch.inference_mode():
            batch = replace(runner.prepare(plan), sample_indices=torch.arange(len(tokens)))
            metadata = runner.backend.build_metadata(batch)
            hidden = runner.model.forward(
                batch, runner.backend, metadata, runner.k_caches, runner.v_caches
            )
            return runner.model.compute_logits(hidden).float()

    def nll_sum(self, tokens: list[int], chunk: int) -> float:
        """Sum of -log p(token | earlier tokens) over tokens[1:], prefilled in chunks."""
        total = 0.0
        for start in range(0, len(tokens), chunk):
            logits = self.chunk_logits(tokens[start : start + chunk], start).double()
            targets = torch.tensor(tokens[start + 1 : start + chunk + 1])
            logprobs = torch.log_softmax(logits[: len(targets)], dim=-1)
            total -= float(logprobs.gather(1, targets.unsqueeze(1)).sum())
        return total

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        tokens, out = list(prompt), []
        with torch.inference_mode():
            plan = BatchPlan(step=1, extends=[Segment("g", 0, tokens, 0, True)])
            for step in range(count):
                token = int(self.runner.forward_logits(plan)[0].argmax())
                out.append(token)
                plan = BatchPlan(
                    step=step + 2, decodes=[Segment("g", 0, [token], len(tokens), True)]
                )
                tokens.append(token)
        return out


def agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(
        next((i for i, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), len(u))
        for u, v in zip(a, b, strict=True)
    )


def evaluate(args: argparse.Namespace) -> tuple[list[PoolResult], dict[str, object]]:
    model = KNOWN_MODELS[DEFAULT_MODEL]
    gguf_path = model.gguf_path()
    meta = metadata_dir(gguf_path, model.name)
    tokenizer = Tokenizer(meta)
    config = ModelConfig.from_hf_dict(json.loads((meta / "config.json").read_text()))
    text = "\n\n".join((ROOT / name).read_text() for name in TEXT_FILES)
    tokens = tokenizer.encode(text)[: args.tokens]
    if len(tokens) < args.tokens:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --tokens {args.tokens}")
    step = max(1, (len(tokens) - args.context) // max(1, args.prompts))
    prompts = [tokens[i * step : i * step + args.context] for i in range(args.prompts)]
    prompts += [tokenizer.encode(p) for p in SHORT_PROMPTS]
    max_len = max(len(tokens), args.context + args.greedy_tokens) + 1
    formats = frozenset(GGUF_FORMATS) if args.weights == "gguf" else frozenset()
    pools = POOLS[args.dtype]
    half = list(pools)[1]
    weights = {
        dtype: read_gguf(gguf_path, dtype, formats).weights
        for dtype in {model for model, _ in pools.values()}
    }
    ppl: dict[str, float] = {}
    greedy: dict[str, list[list[int]]] = {}
    for name, (dtype, kv_dtype) in pools.items():
        runner = Runner(config, weights[dtype], max_len, dtype, kv_dtype)
        ppl[name] = math.exp(runner.nll_sum(tokens, args.chunk) / (len(tokens) - 1))
        greedy[name] = [runner.greedy(p, args.greedy_tokens) for p in prompts]
        print(f"{name}: perplexity {ppl[name]:.4f}", file=sys.stderr)
    total = args.greedy_tokens * len(prompts)
    results = [
        PoolResult(
            kv_cache_dtype=name,
            perplexity=ppl[name],
            activations=str(pools[name][0]).removeprefix("torch."),
            perplexity_vs_float32=ppl[name] / ppl["float32"] - 1,
            perplexity_vs_16bit=ppl[name] / ppl[half] - 1,
            greedy_agreeing_float32=agreeing(greedy[name], greedy["float32"]),
            greedy_agreeing_16bit=agreeing(greedy[name], greedy[half]),
            greedy_total=total,
        )
        for name in pools
    ]
    setup = {
        "model": model.name,
        "weights": WEIGHTS[args.weights],
        "activations": args.dtype,
        "16bit_pool": half,
        "text": list(TEXT_FILES),
        "text_tokens": len(tokens),
        "text_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "chunk": args.chunk,
        "prompts": len(prompts),
        "context": args.context,
        "greedy_tokens": args.greedy_tokens,
        "int8_within_target": abs(ppl["int8"] / ppl[half] - 1) <= PPL_TARGET,
    }
    return results, setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--prompts", type=int, default=4, help="long prompts from the text")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each long prompt")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--weights", choices=list(WEIGHTS), default="gguf")
    parser.add_argument(
        "--dtype", choices=list(POOLS), default="float32", help="the model's activations"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results, setup = evaluate(args)
    half = setup["16bit_pool"]
    print(
        f"{setup['model']}, {setup['weights']}; {setup['text_tokens']} tokens of "
        f"{' + '.join(TEXT_FILES)} in chunks of {args.chunk}"
    )
    print(
        f"| KV pool | activations | perplexity | vs float32 | vs {half} | greedy = float32 | "
        f"greedy = {half} |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.kv_cache_dtype} | {r.activations} | {r.perplexity:.4f} | "
            f"{r.perplexity_vs_float32:+.3%} | {r.perplexity_vs_16bit:+.3%} | "
            f"{r.greedy_agreeing_float32}/{r.greedy_total} | "
            f"{r.greedy_agreeing_16bit}/{r.greedy_total} |"
        )
    print(f"int8 within {PPL_TARGET:.1%} of {half}: {setup['int8_within_target']}")
    if args.json:
        payload = {"setup": setup, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
