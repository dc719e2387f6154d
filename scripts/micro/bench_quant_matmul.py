"""The quantized matmul (kernels/cpu/cpu_quant_matmul.c) against the dense oneDNN projection of
today (executor/layers/linear.py's prepacked Linear), per batch size, on one model's projection
shapes (--shape: the embedded model's by default, or a real size's): where the crossover lies
(executor/layers/linear.py's DENSE_FROM_ROWS).

    python scripts/micro/bench_quant_matmul.py [--formats Q4_1,Q8_0] [--rows 1,4,16,64,256]
        [--shape smollm2-135m|llama-3.2-1b|llama-3.2-3b|qwen2.5-1.5b] [--row-by-row]
        [--dtype float32] [--json out.json]

Formats the ``gguf`` package cannot quantize (the K formats) get random blocks with valid fp16
scales: the speed of a product does not depend on the values. --row-by-row also times the
weights as stored (not in interleaved groups), the layout before the groups.

Prints a table of the best milliseconds of repeated calls (all projections of one layer, plus the LM head
alone) and the quantized/dense ratio; also the weight bytes streamed per call at batch 1 and the
GB/s that makes (the bandwidth a batch-1 step is bound by).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncengine.executor.layers.linear import INTERLEAVE_ENV, Linear, QuantizedLinear
from asyncengine.kernels.cpu import quant_native
from asyncengine.kernels.quant_formats import FORMATS, QuantizedTensor, bf16_rows, f32_rows
from asyncengine.kernels.reference import quant_ref


def model_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int
) -> tuple[list[tuple[str, int, int]], tuple[str, int, int]]:
    """(name, out_features, in_features) of a llama-family layer's projections (qkv and gate_up
    fused), and its LM head."""
    layer = [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]
    return layer, ("lm_head", vocab, hidden)


SHAPES = {
    "smollm2-135m": model_shapes(576, 9, 3, 64, 1536, 49152),
    "llama-3.2-1b": model_shapes(2048, 32, 8, 64, 8192, 128256),
    "llama-3.2-3b": model_shapes(3072, 24, 8, 128, 8192, 128256),
    "qwen2.5-1.5b": model_shapes(1536, 12, 2, 128, 8960, 151936),
    # rows of no whole 256-value super-block (hidden 896, 1152): 32-value block formats only
    "qwen2.5-0.5b": model_shapes(896, 14, 2, 64, 4864, 151936),
    "gemma-3-1b": model_shapes(1152, 4, 1, 256, 6912, 262144),
}

CLOCK: Callable[[], float] = time.perf_counter


def best_ms(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """The fastest of repeated calls: on a shared machine other processes only ever add time,
    so the minimum is the figure least disturbed by them (medians are noise under load)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = CLOCK()
        fn()
        times.append((CLOCK() - start) * 1e3)
    return min(times)


def random_blocks(fmt_name: str, rows: int, cols: int) -> QuantizedTensor:
    """Random blocks of a GGUF format with valid small fp16 scales (its fp16 fields: as
    tests/kernels/test_quantized_kernels.py makes them)."""
    fmt = FORMATS[fmt_name]
    fields = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2)}
    fields |= {"Q4_K": (0, 2), "Q5_K": (0, 2)}
    blocks = cols // fmt.block_size
    data = torch.randint(0, 256, (rows, blocks, fmt.block_bytes), dtype=torch.uint8)
    for offset in fields.get(fmt_name, (208,)):
        scale = (torch.rand(rows, blocks) * 0.002 + 0.0005).to(torch.float16)
        data[:, :, offset : offset + 2] = scale.view(torch.uint8).reshape(rows, blocks, 2)
    return QuantizedTensor(fmt, data.reshape(rows, -1).contiguous(), cols)


def quantize(fmt_name: str, weight: torch.Tensor) -> QuantizedLinear:
    if fmt_name in ("Q4_K", "Q5_K", "Q6_K"):
        return QuantizedLinear([random_blocks(fmt_name, *weight.shape)])
    if fmt_name == "I8":
        return QuantizedLinear([quant_ref.quantize_i8(weight)])
    if fmt_name == "F32":  # the float32 weight as it is, through the native F32 rows
        return QuantizedLinear([f32_rows(weight.float())])
    if fmt_name == "BF16":  # the weight rounded to bfloat16, as it is, through the BF16 rows
        return QuantizedLinear([bf16_rows(weight.to(torch.bfloat16))])
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = FORMATS[fmt_name]
    assert fmt.gguf_type is not None
    raw = gguf_quantize(weight.numpy(), GGMLQuantizationType(fmt.gguf_type))
    data = torch.from_numpy(raw.copy()).reshape(weight.shape[0], -1)
    return QuantizedLinear([QuantizedTensor(fmt, data, int(weight.shape[1]))])


Projection = Callable[[torch.Tensor], torch.Tensor]


def measure(
    fmt_name: str,
    n: int,
    quant: dict[str, QuantizedLinear],
    dense: dict[str, Linear],
    shapes: list[tuple[str, int, int]],
    dtype: torch.dtype,
    lm_head: bool,
    row_by_row: dict[str, QuantizedLinear] | None = None,
) -> dict[str, Any]:
    xs = {name: torch.randn(n, inp).to(dtype) for name, _, inp in shapes}

    layer_names = [name for name, _, _ in shapes if name != "lm_head"]

    def layer(table: Mapping[str, Projection]) -> Callable[[], None]:
        def run() -> None:
            for name in layer_names:
                table[name](xs[name])

        return run

    q_ms = best_ms(layer(quant))
    d_ms = best_ms(layer(dense))
    layer_bytes = sum(quant[name].nbytes for name in layer_names)
    row: dict[str, Any] = {
        "format": fmt_name,
        "rows": n,
        "layer_quantized_ms": q_ms,
        "layer_dense_ms": d_ms,
        "ratio": q_ms / d_ms,
        "layer_weight_bytes": layer_bytes,
        "layer_quantized_gbps": layer_bytes / q_ms / 1e6,
    }
    if row_by_row is not None:
        row["layer_row_by_row_ms"] = best_ms(layer(row_by_row))
        row["layer_row_by_row_gbps"] = layer_bytes / row["layer_row_by_row_ms"] / 1e6
    if lm_head:
        x = xs["lm_head"]
        row["head_quantized_ms"] = best_ms(lambda: quant["lm_head"](x))
        row["head_quantized_gbps"] = quant["lm_head"].nbytes / row["head_quantized_ms"] / 1e6
        row["head_dense_ms"] = best_ms(lambda: dense["lm_head"](x))
        if row_by_row is not None:
            row["head_row_by_row_ms"] = best_ms(lambda: row_by_row["lm_head"](x))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="Q4_1,Q8_0")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--lm-head", action="store_true", help="also time the LM head")
    parser.add_argument(
        "--row-by-row", action="store_true", help="also time the weights as stored (no groups)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --threads 1: count this thread's CPU time, not wall time (a loaded machine)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if args.threads != 1:
            raise SystemExit("--cpu-time needs --threads 1 (other threads' time is not counted)")
        global CLOCK
        CLOCK = time.thread_time
    torch.manual_seed(0)
    layer_shapes, head_shape = SHAPES[args.shape]
    shapes = layer_shapes + ([head_shape] if args.lm_head else [])
    weights = {name: torch.randn(out, inp) * 0.05 for name, out, inp in shapes}
    dense = {name: Linear(w.to(dtype)) for name, w in weights.items()}
    results: list[dict[str, object]] = []
    print(
        f"quantized kernels: {quant_native.isa_name()}, threads {torch.get_num_threads()}, {args.dtype}"
    )
    print(f"shape {args.shape}: {shapes}")
    header = (
        f"{'format':>6} {'rows':>5} {'layer q ms':>10} {'GB/s':>6} {'layer dense':>11} {'ratio':>6}"
    )
    if args.row_by_row:
        header += f" {'row-by-row ms':>13} {'GB/s':>6}"
    if args.lm_head:
        header += f" {'head q ms':>9} {'GB/s':>6} {'head dense':>10}"
    print(header)
    for fmt_name in args.formats.split(","):
        quant = {name: quantize(fmt_name, w) for name, w in weights.items()}
        stored = None
        if args.row_by_row:  # the same blocks, kept as stored
            os.environ[INTERLEAVE_ENV] = "0"
            stored = {
                name: QuantizedLinear([quant_ref.deinterleave(p) for p in q.parts])
                for name, q in quant.items()
            }
            os.environ.pop(INTERLEAVE_ENV)
        for n in (int(r) for r in args.rows.split(",")):
            row = measure(fmt_name, n, quant, dense, shapes, dtype, args.lm_head, stored)
            line = (
                f"{fmt_name:>6} {n:>5} {row['layer_quantized_ms']:>10.3f} "
                f"{row['layer_quantized_gbps']:>6.1f} "
                f"{row['layer_dense_ms']:>11.3f} {row['ratio']:>6.2f}"
            )
            if args.row_by_row:
                line += f" {row['layer_row_by_row_ms']:>13.3f} {row['layer_row_by_row_gbps']:>6.1f}"
            if args.lm_head:
                line += (
                    f" {row['head_quantized_ms']:>9.3f} {row['head_quantized_gbps']:>6.1f}"
                    f" {row['head_dense_ms']:>10.3f}"
                )
            print(line, flush=True)
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
