"""Linear: ``y = x @ weight.T + bias``, with the weight prepacked once for oneDNN on the CPU.

torch's ``F.linear`` on a CPU hands oneDNN a plain [out, in] weight, which it re-lays out into
its blocked format on every call; prepacking (``mkldnn._reorder_linear_weight``) does that once
at load time, and ``mkldnn._linear_pointwise`` multiplies by the packed weight: the same sums in
the same order (bit-identical outputs in bfloat16), 10-20% less time at decode batch sizes and
half at batch 1 on an AVX-512 BF16 CPU (scripts/micro/bench_forward.py). Elsewhere (CUDA, other
dtypes, a torch build without those ops) it is ``F.linear``.

Row blocks (deterministic mode): a GEMM library picks its kernel (blocking, K-splitting, a GEMV
path for one row) from the shape, so a row can be summed in a different order when more rows
share the call (oneDNN's bfloat16 kernel for SmolLM2's 576x1536 down projection changes its
order between 6 and 7 rows; MKL's float32 GEMV differs from its GEMM). Within one
shape the order is the same for every row, whatever the other rows hold
(tests/executor/test_deterministic.py checks both facts). With ``row_block`` set, the rows are padded to
a multiple of it and multiplied ``row_block`` at a time: a request's row meets the same kernel
alone as in a batch of 200. The price is the padding (a lone decode computes ``row_block``
rows) and more, smaller calls for long prefills (scripts/bench_deterministic.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from asyncengine.executor.cpu.cpu_dtype import fastest_cpu_dtype
from asyncengine.executor.cpu.weight_arena import WeightArena
from asyncengine.executor.cpu.weight_pack import pack_parts
from asyncengine.executor.layers import panel_build
from asyncengine.executor.layers.panel_build import PanelBuild
from asyncengine.kernels.cpu import quant_amx_native, quant_i8gemm_native, quant_native
from asyncengine.kernels.quant_formats import (
    BF16,
    F32,
    FLOAT_FORMATS,
    QuantizedTensor,
    cat_rows,
    float_rows,
)

PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works
ENABLE_ENV = "ASYNCENGINE_PACKED_LINEAR"  # "0": plain F.linear (to measure what packing gives)
ROW_BLOCK = 32  # deterministic mode's row block (executor/deterministic.py)
# From this many rows a quantized projection takes the dense product instead (float32
# activations). The interleaved Q8_0 / Q4_0 / Q4_1 stay ahead of the dense product at every step
# size the engine makes (both sides are compute-bound from ~256 rows), so they never hold a
# float32 copy; the interleaved K formats meet it at 32 (Q6_K) to ~128 (Q4_K) rows on a 1B
# model's layer (scripts/micro/bench_quant_matmul.py --shape llama-3.2-1b --formats
# Q4_K,Q5_K,Q6_K --threads 1 --cpu-time); the row-by-row kernels (I8) lose from 64 rows; F32
# rows (a float32 model's own weights) meet the prepacked product from 24, the fused decode step
# from 23. Measured by scripts/micro/bench_quant_matmul.py --threads 1 --cpu-time and
# scripts/micro/bench_decode_step.py --quantization none (docs/BENCHMARKS.md, "Where do the
# quantized products give way to dense ones?").
DENSE_FROM_ROWS = 64
# BF16 rows here (a bfloat16 model on a CPU whose bfloat16 product is slow): not measured, the
# rows kernel keeps every size
DENSE_FROM_ROWS_BY_FORMAT = {
    "Q4_0": 8192, "Q4_1": 8192, "Q5_0": 8192, "Q5_1": 8192, "Q8_0": 8192, "Q4_K": 128,
    "Q5_K": 96, "Q6_K": 32, "F32": 24, "BF16": 8192,
}  # fmt: skip
# With bfloat16 activations on a CPU whose oneDNN runs bfloat16 products fast (AVX-512 BF16 or
# AMX: ``cpu_dtype.fastest_cpu_dtype``) the dense product is ~4x float32's and crosses over much
# sooner; measured per whole step, where the dense weights stream from memory and the quantized
# ones are a third of the bytes (scripts/micro/bench_decode_step.py --dtype bfloat16 --threads 1
# --cpu-time). From the crossover the projection holds both forms.
DENSE_FROM_ROWS_BF16 = 12
# BF16 rows (a bfloat16 model's weights, widened to float32 in the kernel) stream the weights
# best at batch 1 but are compute-bound from 2 rows, where oneDNN's bfloat16 GEMM is not
# (scripts/micro/bench_decode_step.py --quantization none --dtype bfloat16).
BF16_ROWS_DENSE_FROM = 3
# The K formats' from the same 1B layer (bench_quant_matmul.py --shape llama-3.2-1b --dtype
# bfloat16 --threads 1 --cpu-time): the group kernels' ~0.8-2 ms per row against oneDNN's
# bfloat16 product, flat at ~11 ms up to 16 rows
DENSE_FROM_ROWS_BF16_BY_FORMAT = {
    "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 16, "Q4_K": 14, "Q5_K": 11,
    "Q6_K": 7, "BF16": BF16_ROWS_DENSE_FROM,
}  # fmt: skip
# Projections of at least this many inputs (a 1B model's hidden size and up) with bfloat16
# activations: where oneDNN's bfloat16 product meets Q8_0 there (per projection, one thread, CPU
# time: quantized / dense for a 1B layer 1.03 at 8 rows, 1.36 at 12, 0.82 at 4; its LM head
# 1.31 at 8; a 3B layer 0.93 at 6, 1.07 at 8; bench_quant_matmul.py --formats Q8_0 --shape
# llama-3.2-1b --dtype bfloat16 --lm-head --threads 1 --cpu-time). The table's 16 was measured
# per whole step of the 135M model, whose small dense weights stay in cache.
WIDE_INPUT = 2048
DENSE_FROM_ROWS_BF16_WIDE_INPUT = {"Q8_0": 8}
# A projection with bfloat16 activations whose parts are all in AMX_FORMATS takes, on an AMX CPU,
# the AMX product from AMX_FROM_ROWS_BY_FORMAT rows, at any row count from there, instead of the
# dense one (kernels/cpu/cpu_quant_amx.c: each weight unpacked to bfloat16 once per call, the dense
# product's sums without its copy): at 32 rows it reads 2.4x (Q6_K) to 3.6x (Q4_K) fewer bytes
# than the copy, and from 33 rows its panels keep the tile unit as busy as oneDNN's blocking.
# Per projection of a 1B layer, two threads, AMX / dense time (scripts/micro/bench_amx_ab.py's
# shapes): Q4_K at 256 / 1024 / 2048 rows qkv 0.88 / 0.90 / 0.91, gate_up 0.94 / 0.88 / 0.89,
# down 0.87 / 0.86 / 1.1; at 48-192 rows 0.7-1.1 (small projections' copies stay in cache in
# such a loop, not in a step). A 1B Q4_K_M prompt of 512 / 2048 tokens 1.26x / 1.16x faster
# than with dense copies (scripts/bench_real_sizes.py --prefill-lens), and no copy is held.
AMX_FORMATS = quant_amx_native.FORMATS
# Below these rows every format keeps the int8 product (from I8_FROM_ROWS_BY_FORMAT; the group
# kernels below that): AMX unpacks every weight to bfloat16 per call (~10 G values a second a
# core, flat up to 16 rows, its tiles 16 rows), where the int8 product's panels are unpacked
# once. AMX / int8 time per projection of a 1B layer and its LM head, two threads, medians of 7
# (bench_many_rows_step.py --amx-vs-dense Q4_K,Q5_K,Q6_K --amx-against i8 --batches
# 16,24,28,32,48), three runs on the Xeon, whose AMX speed swings the most: at 16-24 rows
# 0.82-1.67 (above 1 in 73 of 80 cells), at 28-32 0.65-1.44, at 48 0.64-1.22. The 32-value
# block formats, int8 / AMX: at 8 rows 0.6-1.0 (Q8_0; Q4_1 0.7-1.1), at 16 0.97-1.4 (Q4_1
# 1.1-1.4), at 32 1.6-2.2, at 128-512 1.8-3.6 (and AMX / dense 0.8-1.3).
AMX_FROM_ROWS_BY_FORMAT = {"Q4_K": 28, "Q5_K": 28, "Q6_K": 32, "Q8_0": 16, "Q4_0": 16, "Q4_1": 16}
# From its dense crossover up to these rows (exclusive), a projection whose parts are all K
# formats (or Q8_0) takes the int8 product where this CPU runs it (kernels/cpu/cpu_quant_i8gemm.c:
# the weights' exact integers, Q4_K's as nibbles, ~0.63 / 1.13 / 1.11 bytes a weight for Q4_K /
# Q5_K / Q6_K against a dense bfloat16 copy's 2; AVX-512 VNNI, or AVX2 for the K formats:
# 1.3-3.9x a dense float32 copy at 32-256 rows, docs/KERNELS.md) instead of the dense product, and
# builds no dense copy for those rows. Per projection of a 1.5B layer and its LM head, dense bfloat16 time /
# int8 time (one thread, CPU time, a shared machine: +-15%; scripts/micro/bench_many_rows_step.py
# --i8-crossovers Q4_K,Q5_K,Q6_K --shape qwen2.5-1.5b --threads 1 --cpu-time): Q4_K 1.5-2.1 at
# 16 rows, 1.3-1.7 at 32, 1.2-1.5 at 64, ahead up to 2048 rows; Q5_K 1.1-1.5 at 16-256; Q6_K
# 1.1-1.3 at 16-256. At 512-2048 rows (two threads, the same script with --batches): Q5_K
# 1.11-1.47, Q6_K 0.99-1.51 (its values centred, the min term one constant a column); a whole
# prompt of 512 / 2048 tokens 1.25-1.33x / 1.07-1.14x against the dense copies at those rows
# (scripts/bench_real_sizes.py --prefill-lens). So every K format takes it at any row count (no
# dense copy built); the parts of a projection in several formats take the smallest.
# The 32-value block formats (their exact values as bytes, the activations' scales per 32 too:
# 1.25 bytes a weight for Q8_0 / Q4_0, 1.375 for Q4_1) against the dense bfloat16 product, per
# projection of a 1.5B layer and its LM head (the same script, --i8-crossovers Q8_0,Q4_0,Q4_1
# --shape qwen2.5-1.5b, one thread, CPU time): Q8_0 1.3-1.9 at 8-64 rows, 1.1-1.4 at 256-2048
# (the rows met 256 at a time: down's 0.9 at 2048 otherwise, its activations out of cache), the
# K formats 1.1-1.4 at 2048; Q4_0 1.2-1.8 at 8-64, 1.2-1.4 at 128-1024; Q4_1 (its min one more
# multiply-add a block) 1.1-1.6 at 16-64, 1.03-1.22 at 128-1024. So they too take it at any row
# count.
I8_BELOW_ROWS_BY_FORMAT = {
    "Q4_K": 1 << 30, "Q5_K": 1 << 30, "Q6_K": 1 << 30, "Q8_0": 1 << 30, "Q4_0": 1 << 30,
    "Q4_1": 1 << 30, "Q5_0": 1 << 30, "Q5_1": 1 << 30,
}  # fmt: skip
# With bfloat16 activations, where every part takes the int8 product, it takes it from this many
# rows even below the dense crossover (in place of the quantized group kernels; float32 ones keep
# their crossovers, as measured). The group kernels / the int8 product per projection of a 1B
# layer and its LM head, two threads (bench_many_rows_step.py --i8-crossovers
# Q4_K,Q5_K,Q6_K,Q8_0 --shape llama-3.2-1b --batches 4,5,6,8): at 5 rows Q4_K 1.47-1.95, Q5_K
# 0.93-1.73, Q6_K 1.19-2.47, Q8_0 1.21-1.81; at 4 mixed (0.71-2.47), where a bfloat16 model's
# fused decode step takes the batch anyway (native_decode.BF16_NATIVE_DECODE_MAX_ROWS); whole
# 5-row steps of 1B Q4_K_M, Q5_K_M and Q8_0 models 1.09-1.23x faster from 5 than from 6 or 8.
# Q4_0 1.3-1.6 at 8, 2.0-2.5 at 16-64; Q4_1 0.8-1.3 at 8, 1.7-2.2 at 16-64 (a 1.5B layer).
# Rows of a partial last super-block (Qwen2.5-0.5B's 896, Gemma 3 1B's 1152: padded with zero
# blocks, 1/7-1/9 more products) keep these starts: a 1152 x 896 projection, one thread, CPU
# time, a loaded machine, 1.5-1.6 (Q8_0) at 5 rows, 1.4 (Q4_0) at 8, 1.25 (Q4_1) at 16; at 64
# rows a 1152 x 1152 one 1.9 / 1.6 / 1.3 (--i8-crossovers Q8_0,Q4_0,Q4_1 --shape qwen2.5-0.5b,
# gemma-3-1b). SmolLM2's layers (576: 1/3 more) 1.2-1.6; its 49152 x 576 Q8_0 LM head, bound by
# the bytes it streams, 0.7 at 5-8 rows (a 49152 x 512 one 0.86), 1.05 at 12, 1.4 at 16.
# Q5_0 / Q5_1 (llama-quantize's blocks for those rows in Q4_K_M / Q5_K_M files) take Q4_0's /
# Q4_1's crossovers: the same panels, one more bit a value in the file.
I8_FROM_ROWS_BY_FORMAT = {
    "Q8_0": 5, "Q4_0": 8, "Q4_1": 16, "Q5_0": 8, "Q5_1": 16, "Q4_K": 5, "Q5_K": 5, "Q6_K": 5,
}  # fmt: skip
# Where the int8 product is the AVX2 kernel (a CPU without VNNI: float32 activations by default),
# float32 activations take it from these rows below the dense crossover. Group kernels / int8
# product per projection of a 1B layer and its LM head, two threads, a Zen 3 ISA build
# (bench_many_rows_step.py --i8-crossovers Q4_K,Q5_K,Q6_K --dtype float32): Q6_K 1.1-1.6 at 2
# rows, 1.6-2.1 at 3, 2.8-3.6 at 8-64 (its group kernels' 16-value sub-blocks); Q5_K 0.8-0.96
# at 4, 1.1-1.2 at 8, 1.2-1.4 at 12-32; Q4_K 0.8-1.3 at 2-12, 1.0-1.1 at 16-64. A 1B Q4_K_M's
# fused decode step then takes up to 7 rows, where it took 31: 8 / 16 at once 1.3-1.4x / 1.2-1.4x
# out tok/s (bench_real_sizes.py --concurrency 4 8 16 32, two runs, against its 4 at once).
I8_FROM_ROWS_FLOAT32_AVX2 = {"Q4_K": 16, "Q5_K": 8, "Q6_K": 8}
# Deterministic mode keeps one product at every row count (``QuantizedLinear``'s
# ``i8_every_row``): the int8 one for these formats, whose panels read about the file's bytes and
# so keep up with the group kernels at one row (group / int8 time per projection of a 1B layer and
# its LM head, two threads: Q4_K 0.80-1.15, Q6_K 0.84-1.04, Q8_0 0.85-1.00, Q5_K 0.61-0.89 at 1
# row; every format 2-3.6 at 64 rows); Q4_0 / Q4_1 panels hold 2.2x the file's bytes (0.41-0.67
# at 1 row), so they keep the group kernels (bench_many_rows_step.py --i8-crossovers
# Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1 --shape llama-3.2-1b --batches 1,2,64)
I8_EVERY_ROW_FORMATS = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0"})
# While a projection's int8 panels are built between steps (``QuantizedLinear.defer_i8``), its
# calls take the quantized product instead of waiting, until they have taken it for this many
# rows in all; then the call packs what is left of its panels (ski rental: packing a projection
# costs what the quantized product loses to the int8 one over ~150-330 rows, so a busy engine
# pays at most twice; per projection of a 1.5B Q4_K_M model, two threads: pack 1.5-19 ms, the
# LM head 177 ms, against the quantized / int8 products at 16-128 rows).
I8_DEFERRED_ROWS = 256
# A float32 LM head (SmolLM2's 49152 x 576) meets the dense product sooner than the layers
# (scripts/micro/bench_quant_matmul.py --formats F32 --lm-head --threads 1 --cpu-time)
F32_HEAD_DENSE_FROM_ROWS = 8
# "0": a float32 (bfloat16) model's projections stay dense ``Linear``s (oneDNN at every batch
# size) instead of F32 (BF16) rows for the native products and the fused decode step (to measure
# what they give)
FLOAT_ROWS_ENV = "ASYNCENGINE_F32_ROWS"
# "0": quantized weights stay row by row as stored, instead of in interleaved groups of 8 rows
# (kernels/cpu/cpu_quant_blocks.h; to measure what the layout gives)
INTERLEAVE_ENV = "ASYNCENGINE_INTERLEAVE"


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return packed


class DenseBudget:
    """Bytes one model's dense copies (``QuantizedLinear.dense``) may still take together: each
    copy takes its bytes when it is built and keeps them. A projection refused one keeps its
    quantized products at every size; a copy buys speed, not correctness."""

    __slots__ = ("left",)

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def take(self, nbytes: int) -> bool:
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


class Linear:
    """Once packed, the plain weight is no longer referenced from here (the packed copy is a
    second tensor of the same size: keeping both doubled a dense model's resident weights)."""

    __slots__ = ("bias", "dtype", "out_features", "packed", "row_block", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_block: int | None = None,
        pack: bool = True,
    ) -> None:
        """``pack``: False multiplies by ``weight`` itself (no second copy: oneDNN lays it out
        on each call, 1.0-1.4x the packed time from 32 rows)."""
        self.bias = bias
        self.packed = _pack(weight) if pack else None
        self.weight = weight if self.packed is None else None  # [out, in]
        self.dtype = weight.dtype
        self.out_features = int(weight.shape[0])
        self.row_block = row_block  # None: one call for all rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block is None or x.dim() != 2:
            return self._multiply(x)
        return self._in_row_blocks(x, self.row_block)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            x2 = x.reshape(-1, x.shape[-1])
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x2, self.packed, self.bias, "none", [], ""
            )
            return out.reshape(*x.shape[:-1], self.out_features)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def _in_row_blocks(self, x: torch.Tensor, block: int) -> torch.Tensor:
        rows = x.shape[0]
        if rows == block:
            return self._multiply(x)
        padded = -(-rows // block) * block
        source = x.new_zeros((padded, x.shape[1]))
        source[:rows] = x
        if padded == block:
            return self._multiply(source)[:rows]
        out = x.new_empty((padded, self.out_features))
        for start in range(0, padded, block):
            out[start : start + block] = self._multiply(source[start : start + block])
        return out[:rows]


class QuantizedLinear:
    """``y = x @ weight.T + bias`` with the weight kept quantized (GGUF blocks or I8) and the
    products taken by kernels/cpu/cpu_quant_matmul.c: x is quantized once per call to int8 blocks,
    then each part (a fused projection whose pieces have different formats, as q/k/v in Q4_K_M
    files, is several parts) writes its columns of one output.

    Each row's sums run in the same order whatever the other rows hold, so outputs are batch
    invariant and deterministic mode needs no row blocks here; it keeps one product for every row
    count: the int8 one where ``i8_every_row``, every part is in ``I8_EVERY_ROW_FORMATS`` and
    this CPU runs it for them (its panels from the budget, ``build_i8_every_row``), else the
    group kernels.

    ``dense_from_rows``: calls with at least this many rows take the dense product of today's
    ``Linear`` (prepacked oneDNN) instead, the weight dequantized to the activation dtype the first
    time such a call comes (so an idle or lightly loaded engine holds only the quantized bytes;
    under large batches both: the quantized bytes and one packed dense copy), where ``budget``
    (shared by a model's projections; None: no limit) has room for it. None: always the
    quantized kernel. From ``dense_from_rows`` (or sooner, ``I8_FROM_ROWS_BY_FORMAT``) up to
    ``I8_BELOW_ROWS_BY_FORMAT`` K-format and Q8_0 parts take the int8 product instead, where this
    CPU runs it (``_i8``: its panels, built by the first such call from the same budget).
    """

    __slots__ = (
        "_amx",
        "_amx_from",
        "_dense",
        "_i8",
        "_i8_below",
        "_i8_build",
        "_i8_from",
        "_i8_from_float32",
        "_i8_every_row",
        "_i8_rented",
        "bias",
        "budget",
        "dense_from_rows",
        "in_features",
        "out_features",
        "parts",
    )

    def __init__(
        self,
        parts: Sequence[QuantizedTensor],
        bias: torch.Tensor | None = None,
        dense_from_rows: int | None = None,
        arena: WeightArena | None = None,
        budget: DenseBudget | None = None,
        i8_every_row: bool = False,
    ) -> None:
        """``arena``: where the parts are written (the model's weights in step order), else
        each in a tensor of its own; ``i8_every_row`` (without ``dense_from_rows``): the int8
        product for every row count (above)."""
        if not parts or any(p.cols != parts[0].cols for p in parts):
            raise ValueError("a quantized linear needs parts of one input width")
        self.parts = _packed(parts, arena)
        self.in_features = parts[0].cols
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else bias.float().contiguous()
        self.dense_from_rows = dense_from_rows
        self.budget = budget
        self._dense: Linear | None = None
        # the int8 product's panels, built by the first call that takes it, or between steps
        # (``defer_i8``: ``_i8_build`` holds them while they are built)
        self._i8: list[quant_i8gemm_native.I8Panels] | None = None
        self._i8_below = 0 if dense_from_rows is None else i8_below_rows(self.parts)
        # every part in a format the AMX product takes on this CPU (asked once per linear), and
        # the rows from which it takes them: the int8 product below, else the group kernels up
        # to the dense crossover at the latest (AMX gives the dense product's sums without a copy)
        self._amx = dense_from_rows is not None and all(
            p.format.name in AMX_FORMATS and quant_amx_native.takes(p) for p in self.parts
        )
        self._amx_from = 1 << 30
        if self._amx and dense_from_rows is not None:
            by_format = amx_from_rows(self.parts)
            self._amx_from = by_format if self._i8_below else min(by_format, dense_from_rows)
        self._i8_from = i8_from_rows(self.parts) if self._i8_below else 1 << 30
        self._i8_from_float32 = (
            i8_from_rows(self.parts, I8_FROM_ROWS_FLOAT32_AVX2)
            if self._i8_below and quant_i8gemm_native.kernel_width() == 256
            else 1 << 30
        )
        self._i8_build: PanelBuild | None = None
        self._i8_rented = 0  # rows the quantized product took while they were deferred
        # deterministic mode's int8 product at every row count, its panels built whole before
        # the first call's rows (never deferred: a row's output must not depend on when it came)
        self._i8_every_row = (
            i8_every_row
            and dense_from_rows is None
            and all(p.format.name in I8_EVERY_ROW_FORMATS for p in self.parts)
            and i8_below_rows(self.parts) > 0
        )

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # rows as they come (no reshape either way: each torch call costs ~20-50 us in a batch-1
        # step, which runs with the caches cold after streaming the weights)
        flat = x.dim() == 2 and x.shape[1] == self.in_features
        x2 = x if flat else x.reshape(-1, self.in_features)
        out = self._product(x2.shape[0], x2.dtype)(x2)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, n: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product that takes ``n`` rows of activations in ``dtype``, by the crossovers."""
        if self._i8_every_row and self.build_i8_every_row():
            return self._i8_product
        if self._amx and dtype == torch.bfloat16 and n >= self._amx_from:
            return self._amx_product
        i8_from = self._i8_from_rows(dtype)
        if self.dense_from_rows is not None and (
            n >= self.dense_from_rows or i8_from <= n < self._i8_below
        ):
            if n < self._i8_below and self._i8_allowed(n):
                return self._i8_product
            if n < self._i8_below:  # panels on their way: the product without them (AMX from
                # the dense crossover, as where the budget refuses panels; else the group kernels)
                if self._amx and dtype == torch.bfloat16 and n >= self.dense_from_rows:
                    return self._amx_product
                return self._quantized
            if self.dense_allowed(dtype):
                return self.dense(dtype)
            return self._quantized
        return self._quantized

    def build_i8_every_row(self) -> bool:
        """Whether the int8 product takes every row count (``i8_every_row``), its panels built
        now if they are not yet (the parts' bytes must be written: the model calls it once its
        weight arena is); where the budget refuses them, the group kernels take every row
        count from the first call on."""
        if self._i8_every_row and self._i8 is None and not self._finish_i8():
            self._i8_every_row = False
        return self._i8_every_row

    def _i8_from_rows(self, dtype: torch.dtype) -> int:
        """Rows from which activations in ``dtype`` take the int8 product below the dense
        crossover (``I8_FROM_ROWS_BY_FORMAT``, float32 ``I8_FROM_ROWS_FLOAT32_AVX2``)."""
        return self._i8_from if dtype == torch.bfloat16 else self._i8_from_float32

    def group_kernels_below(self, dtype: torch.dtype) -> int:
        """Rows from which ``_product`` leaves the quantized group kernels for activations in
        ``dtype`` (the AMX, int8 or dense product, by the crossovers; a budget that refuses
        copies or panels keeps them longer)."""
        if self._i8_every_row:
            return 1
        rows = [self.dense_from_rows or 1 << 30]
        i8_from = self._i8_from_rows(dtype)
        if i8_from < self._i8_below:
            rows.append(i8_from)
        if dtype == torch.bfloat16 and self._amx:
            rows.append(self._amx_from)
        return min(rows)

    def float32_out(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` as float32 [rows, out_features] from 2-D x (the LM head's logits): the
        group kernels and the int8 and AMX products write their float32 sums without rounding
        them to bfloat16 first (nor a pass widening them after); a dense copy's output is
        widened."""
        product = self._product(x.shape[0], x.dtype)
        if product == self._i8_product:
            return self._i8_product(x, torch.float32)
        if product == self._amx_product:
            return self._amx_product(x, torch.float32)
        if product == self._quantized:
            return self._quantized(x, torch.float32)
        return product(x).float()

    def silu_and_mul_product(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))`` for 2-D gate_up = gate | up, where ``silu_and_mul`` is
        layer_ops_native's: the int8 product makes and quantizes each row of SwiGLU itself (the
        same values, never written out: quant_i8gemm_native.silu_linear)."""
        if self._product(gate_up.shape[0], gate_up.dtype) == self._i8_product:
            assert self._i8 is not None
            if len(self._i8) == 1:
                return quant_i8gemm_native.silu_linear(gate_up, self._i8[0], self.bias)
        return self(silu_and_mul(gate_up))

    def dense_allowed(self, dtype: torch.dtype) -> bool:
        """A dense copy in dtype is here, or the budget takes one (its bytes as oneDNN holds it),
        or the stored rows are that dense weight already (``_stored_dense``: no copy needed)."""
        if self.budget is None or (self._dense is not None and self._dense.dtype == dtype):
            return True
        return self._stored_dense(dtype) is not None or self._take_dense_bytes(dtype)

    def _take_dense_bytes(self, dtype: torch.dtype) -> bool:
        nbytes = self.out_features * self.in_features * dtype.itemsize
        return self.budget is None or self.budget.take(nbytes)

    def _stored_dense(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The stored weight as a dense [out, in] tensor of ``dtype`` without a copy: one F32
        (BF16) part, as a float32 (bfloat16) model's rows are; None for anything else."""
        stored = {torch.float32: F32, torch.bfloat16: BF16}.get(dtype)
        if stored is None or len(self.parts) != 1 or self.parts[0].format != stored:
            return None
        return self.parts[0].data.view(dtype)

    def _i8_allowed(self, rows: int) -> bool:
        """The int8 product's panels are here, or they are built now: where they are deferred,
        once the quantized product has taken ``I8_DEFERRED_ROWS`` rows meanwhile (the calls
        before take it); else where the budget takes them (refused, the projection stops
        asking)."""
        if self._i8 is not None:
            return True
        if self._i8_build is not None and self._i8_rented + rows < I8_DEFERRED_ROWS:
            self._i8_rented += rows
            return False
        return self._finish_i8()

    def takes_i8(self, dtype: torch.dtype) -> bool:
        """Some row count of activations in ``dtype`` takes the int8 product (``_product``):
        not a bfloat16 Q4_1 projection on an AMX CPU, whose AMX product starts where it would."""
        if self._i8_below == 0 or self.dense_from_rows is None:
            return False
        upto = self._i8_below
        if self._amx and dtype == torch.bfloat16:
            upto = min(upto, self._amx_from)
        return min(self.dense_from_rows, self._i8_from_rows(dtype)) < upto

    def defer_i8(self, dtype: torch.dtype) -> bool:
        """Whether the int8 panels will be built by ``build_i8_step`` calls (this projection
        takes the int8 product for activations in ``dtype`` and has no panels yet); until they
        are, the calls that would take it take the quantized product, up to ``I8_DEFERRED_ROWS``
        rows in all."""
        if not self.takes_i8(dtype) or self._i8 is not None:
            return False
        if self._i8_build is None:
            self._i8_build = PanelBuild(self.parts)
        return True

    @property
    def i8_deferred(self) -> bool:
        """Deferred panels (``defer_i8``) are not all built yet."""
        return self._i8_build is not None

    def build_i8_step(self) -> None:
        """One row range of the deferred panels (``defer_i8``). The first takes the panels'
        bytes from the budget (refused: no panels, nothing deferred)."""
        build = self._i8_build
        if build is None or (build.panels is None and not self._take_i8_bytes(build)):
            return
        build.step()
        if build.done:
            self._i8, self._i8_build = build.finish(), None

    def _finish_i8(self) -> bool:
        """The panels built now (what a deferred build has left), where the budget takes them."""
        build = self._i8_build or PanelBuild(self.parts, panel_build.WHOLE_PARTS)
        if build.panels is None and not self._take_i8_bytes(build):
            return False
        self._i8, self._i8_build = build.finish(), None
        return True

    def _take_i8_bytes(self, build: PanelBuild) -> bool:
        """The budget takes the panels' bytes; refused, the projection stops asking."""
        if self.budget is None or self.budget.take(build.nbytes):
            return True
        self._i8_below, self._i8_build = 0, None
        if self._amx and self.dense_from_rows is not None:  # from the dense crossover instead
            self._amx_from = min(self._amx_from, self.dense_from_rows)
        return False

    def _i8_product(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each part's columns of one output (x's dtype or ``out_dtype``: float32) by the int8
        product (``_i8`` built)."""
        assert self._i8 is not None
        if len(self._i8) == 1:
            return quant_i8gemm_native.linear(x, self._i8[0], self.bias, out_dtype=out_dtype)
        out = torch.empty((x.shape[0], self.out_features), dtype=out_dtype or x.dtype)
        start = 0
        for panels in self._i8:
            bias = None if self.bias is None else self.bias[start : start + panels.rows]
            part_out = out[:, start : start + panels.rows]
            quant_i8gemm_native.linear(x, panels, bias, part_out, out_dtype=out.dtype)
            start += panels.rows
        return out

    def dense(self, dtype: torch.dtype) -> Linear:
        """The weight dequantized to dtype as a prepacked ``Linear`` (built once, then kept)."""
        if self._dense is None or self._dense.dtype != dtype:
            stored = self._stored_dense(dtype)
            if stored is not None:  # prepacked (a second copy) where the budget takes it
                bias = None if self.bias is None else self.bias.to(dtype)
                self._dense = Linear(stored, bias, pack=self._take_dense_bytes(dtype))
                return self._dense
            if dtype == torch.float32 and all(p.format == F32 for p in self.parts):
                self._dense = Linear(self._f32_weight(), self.bias)  # prepacked: a second copy
                return self._dense
            if dtype == torch.bfloat16 and all(p.format == BF16 for p in self.parts):
                weights = [p.data.view(torch.bfloat16) for p in self.parts]
                weight = weights[0] if len(weights) == 1 else torch.cat(weights)
                bias = None if self.bias is None else self.bias.to(dtype)
                self._dense = Linear(weight, bias)  # prepacked: a second copy
                return self._dense
            weight = torch.cat([quant_native.dequantize_rows(p, None, dtype) for p in self.parts])
            bias = None if self.bias is None else self.bias.to(dtype)
            self._dense = Linear(weight, bias)
        return self._dense

    def _f32_weight(self) -> torch.Tensor:
        """F32 parts' rows as one float32 [out, in] tensor: a view of the stored bytes where
        there is one part (the usual case: same-format parts are merged)."""
        weights = [p.data.view(torch.float32) for p in self.parts]
        return weights[0] if len(weights) == 1 else torch.cat(weights)

    def _amx_product(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each part's columns of one output (x's dtype or ``out_dtype``: float32) by the AMX
        product (``_amx`` holds)."""
        if len(self.parts) == 1:
            return quant_amx_native.linear(x, self.parts[0], self.bias, out_dtype=out_dtype)
        out = torch.empty((x.shape[0], self.out_features), dtype=out_dtype or x.dtype)
        start = 0
        for part in self.parts:
            rows = part.shape[0]
            bias = None if self.bias is None else self.bias[start : start + rows]
            quant_amx_native.linear(x, part, bias, out[:, start : start + rows], out.dtype)
            start += rows
        return out

    def _quantized(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each part's columns of one output (x's dtype or ``out_dtype``: float32) by the group
        kernels."""
        if len(self.parts) == 1:  # one native call
            return quant_native.quant_linear(x, self.parts[0], self.bias, out_dtype=out_dtype)
        activation = quant_native.quantize_q8(x)
        out = torch.empty((x.shape[0], self.out_features), dtype=out_dtype or x.dtype)
        start = 0
        for part in self.parts:
            rows = part.shape[0]
            bias = None if self.bias is None else self.bias[start : start + rows]
            quant_native.matmul_quantized(activation, part, out[:, start : start + rows], bias)
            start += rows
        return out


def amx_from_rows(parts: Sequence[QuantizedTensor]) -> int:
    """Rows from which these parts, all in ``AMX_FORMATS``, take the AMX product
    (``AMX_FROM_ROWS_BY_FORMAT``)."""
    return max(AMX_FROM_ROWS_BY_FORMAT[p.format.name] for p in parts)


def i8_below_rows(parts: Sequence[QuantizedTensor]) -> int:
    """Rows below which these parts take the int8 product from their dense crossover
    (``I8_BELOW_ROWS_BY_FORMAT``); 0: never (a part it does not take, or no fast kernel here)."""
    if not all(
        p.format.name in I8_BELOW_ROWS_BY_FORMAT and quant_i8gemm_native.takes(p) for p in parts
    ):
        return 0
    if not quant_i8gemm_native.available(formats={p.format.name for p in parts}):
        return 0
    return min(I8_BELOW_ROWS_BY_FORMAT[p.format.name] for p in parts)


def i8_from_rows(
    parts: Sequence[QuantizedTensor], by_format: Mapping[str, int] = I8_FROM_ROWS_BY_FORMAT
) -> int:
    """Rows from which these parts take the int8 product below their dense crossover
    (``by_format``; a part without an entry: never below it)."""
    return max(by_format.get(p.format.name, 1 << 30) for p in parts)


def _interleaved(part: QuantizedTensor) -> QuantizedTensor:
    """The part in interleaved row groups where its format has them and the native library is
    here (Q8_0 / Q4_0 / Q4_1: 1.1-3x faster batch-1 products, docs/BENCHMARKS.md; the K formats
    ~2x, scripts/micro/bench_quant_matmul.py --row-by-row)."""
    if os.environ.get(INTERLEAVE_ENV, "1") == "0" or not quant_native.available():
        return part
    return quant_native.interleave(part)


def _packed(parts: Sequence[QuantizedTensor], arena: WeightArena | None) -> list[QuantizedTensor]:
    """The parts merged by format and interleaved, written once (executor/cpu/weight_pack.py);
    where the native packer is missing, through torch's copies (then moved into the arena)."""
    interleave = os.environ.get(INTERLEAVE_ENV, "1") != "0" and quant_native.available()
    packed = pack_parts(parts, arena, interleave)
    if packed is not None:
        return packed
    packed = [_interleaved(p) for p in _merge_same_format(parts)]
    if arena is None:
        return packed
    moved = []
    for part in packed:
        view = arena.take(*part.data.shape)
        view.copy_(part.data)
        moved.append(QuantizedTensor(part.format, view, part.cols, part.interleaved))
    return moved


def _merge_same_format(parts: Sequence[QuantizedTensor]) -> list[QuantizedTensor]:
    """Adjacent parts of one format as one (one kernel call, better thread balance)."""
    merged: list[QuantizedTensor] = []
    for part in parts:
        if merged and merged[-1].format == part.format:
            fused = cat_rows([merged[-1], part])
            assert isinstance(fused, QuantizedTensor)
            merged[-1] = fused
        else:
            merged.append(part.contiguous())
    return merged


def dense_from_rows(parts: Sequence[QuantizedTensor], dtype: torch.dtype = torch.float32) -> int:
    """The row count from which these parts' product is cheaper dense (the smallest crossover
    of their formats; interleaved groups only where the native library makes them), for
    activations in ``dtype``: bfloat16 ones have their own table where this CPU runs dense
    bfloat16 products fast (elsewhere the float32 one, whose crossovers lie past any step)."""
    grouped = os.environ.get(INTERLEAVE_ENV, "1") != "0" and quant_native.available()
    if dtype == torch.bfloat16 and fastest_cpu_dtype() == torch.bfloat16:
        table, generic = DENSE_FROM_ROWS_BF16_BY_FORMAT, DENSE_FROM_ROWS_BF16
    else:
        table, generic = DENSE_FROM_ROWS_BY_FORMAT, DENSE_FROM_ROWS
    return min(
        _crossover(p, table, generic) if grouped or p.format in FLOAT_FORMATS else generic
        for p in parts
    )


def _crossover(part: QuantizedTensor, table: dict[str, int], generic: int) -> int:
    """``part``'s row in ``table``, or its wide-input row where the bfloat16 table applies."""
    if table is DENSE_FROM_ROWS_BF16_BY_FORMAT and part.cols >= WIDE_INPUT:
        wide = DENSE_FROM_ROWS_BF16_WIDE_INPUT.get(part.format.name)
        if wide is not None:
            return wide
    return table.get(part.format.name, generic)


def _as_float_rows(
    parts: Sequence[torch.Tensor | QuantizedTensor], dtype: torch.dtype, row_block: int | None
) -> list[QuantizedTensor] | None:
    """Dense float32 (bfloat16) CPU parts of a float32 (bfloat16) model as F32 (BF16) rows over
    the same bytes (the native products and the fused decode step), where the native library is
    here; None: they stay a dense ``Linear`` (deterministic mode's row blocks, other dtypes and
    devices, or turned off)."""
    if (
        dtype not in (torch.float32, torch.bfloat16)
        or row_block is not None
        or os.environ.get(FLOAT_ROWS_ENV, "1") == "0"
        or not all(
            isinstance(p, torch.Tensor) and p.device.type == "cpu" and p.dtype == dtype
            for p in parts
        )
        or not quant_native.available()
    ):
        return None
    return [float_rows(p) for p in parts if isinstance(p, torch.Tensor)]


def make_linear(
    parts: Sequence[torch.Tensor | QuantizedTensor],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    row_block: int | None = None,
    f32_dense_from_rows: int | None = None,
    arena: WeightArena | None = None,
    budget: DenseBudget | None = None,
) -> Linear | QuantizedLinear:
    """One linear over the rows of ``parts`` (q/k/v or gate/up fused): quantized when every part
    is, dense (``Linear``) otherwise, a quantized part among dense ones being dequantized. Dense
    float32 (bfloat16) parts on a CPU become F32 (BF16) rows (``QuantizedLinear``: the native
    products up to their crossover, the fused decode step) where ``_as_float_rows`` allows;
    ``f32_dense_from_rows``: F32 rows' crossover where this shape's differs from the layers' (the
    LM head's); ``arena``: where quantized parts are written and ``budget`` the bytes their dense
    copies may take (``QuantizedLinear``)."""
    rows = _as_float_rows(parts, dtype, row_block)
    if rows is not None:
        head = f32_dense_from_rows if dtype == torch.float32 else None
        return QuantizedLinear(rows, bias, head or dense_from_rows(rows, dtype), arena, budget)
    if all(isinstance(p, QuantizedTensor) for p in parts):
        quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
        # deterministic mode (row_block) keeps one quantized product at every batch size (the
        # int8 one where it keeps up at one row: 2-3.6x the group kernels at 64 rows): each is
        # batch invariant, a switch between products at some size would not be
        if row_block is not None:
            return QuantizedLinear(quantized, bias, None, arena, budget, i8_every_row=True)
        crossover = dense_from_rows(quantized, dtype)
        return QuantizedLinear(quantized, bias, crossover, arena, budget)
    dense = [
        quant_native.dequantize_rows(p, None, torch.float32).to(dtype)
        if isinstance(p, QuantizedTensor)
        else p
        for p in parts
    ]
    weight = dense[0] if len(dense) == 1 else torch.cat(dense)
    return Linear(weight, bias, row_block)
