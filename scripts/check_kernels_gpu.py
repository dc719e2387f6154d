"""Correctness sweep of the compiled Triton attention kernels on a CUDA GPU.

The unit tests run the kernels under the Triton interpreter on tiny shapes; this runs the
compiled kernels on random ragged batches of realistic lengths against a float64 oracle written
here (one request at a time, no paging tricks): page sizes 1 and 16, GQA ratios 1, 3, 4 and 7,
head dims 64 and 128, bf16 / fp16 / fp32, forced split counts, prefixes that end mid-page;
int8 and fp8 (e4m3, compute capability >= 8.9) pools beside bf16 / fp32 activations too, the
oracle over their dequantized rows, and their stores (store_kv, rotary_store) against the torch
twins bit for bit (kernels/reference/kv_int8_ref.py, kv_fp8_ref.py). Pool slots no request owns
hold NaN, so a kernel that reads a key it should not see fails.

    python scripts/check_kernels_gpu.py [--cases 200] [--seed 0]

Autotuning is off here (one config per kernel; scripts/micro/bench_kernels.py checks the tuned
configs on its shapes). Prints one line per (kernel, dtype) with the worst relative error and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

# One config per kernel (set before asyncengine.kernels.triton_* load): every shape below is a new
# specialization, and autotuning each would compile every config for it.
os.environ.setdefault("ASYNCENGINE_TRITON_AUTOTUNE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine.script_main import run_main

# ||out - ref|| / ||ref|| limits (METHOD: fp32 far under 1e-3; half-precision operands 1e-3..1e-2)
LIMITS = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# quantized pools (rows of one-byte values and their scales) and the activations they sit beside
POOLS = (torch.int8, torch.float8_e4m3fn)
POOL_ACTIVATIONS = (torch.bfloat16, torch.float32)
DEVICE = "cuda"
SCALE = 1.0  # lengths shrink by this (a CPU dry run under the interpreter)


@dataclass(slots=True)
class Paged:
    k_cache: torch.Tensor  # [S, Hkv, D] (quantized: D + 2), NaN where no request owns the slot
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, P] int32
    slots: list[torch.Tensor]  # each request's token slots, in position order


def paged(
    lengths: list[int],
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    pool: torch.dtype | None = None,
) -> Paged:
    pages = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages) + 5
    order = torch.randperm(num_pages, device=DEVICE)
    table = torch.zeros((len(lengths), max(max(pages), 1) + 2), dtype=torch.int32, device=DEVICE)
    shape = (num_pages * page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    slots, taken = [], 0
    for row, (n, count) in enumerate(zip(lengths, pages, strict=True)):
        mine = order[taken : taken + count]
        taken += count
        table[row, :count] = mine.to(torch.int32)
        pos = torch.arange(n, device=DEVICE)
        slot = mine[pos // page_size] * page_size + pos % page_size
        k_cache[slot] = torch.randn((n, kv_heads, head_dim), device=DEVICE).to(dtype)
        v_cache[slot] = torch.randn((n, kv_heads, head_dim), device=DEVICE).to(dtype)
        slots.append(slot)
    if pool is not None:
        k_cache, v_cache = quantized(k_cache, slots, pool), quantized(v_cache, slots, pool)
    return Paged(k_cache, v_cache, table, slots)


def quantized(cache: torch.Tensor, slots: list[torch.Tensor], pool: torch.dtype) -> torch.Tensor:
    """The requests' rows of a float pool quantized into a ``pool`` one (the torch twins); the
    other rows 0xFF bytes, whose scale reads as NaN."""
    from asyncengine.kernels.reference import kv_fp8_ref, kv_int8_ref

    twin = kv_int8_ref.quantize_kv if pool == torch.int8 else kv_fp8_ref.quantize_kv_fp8
    shape = (*cache.shape[:-1], cache.shape[-1] + kv_int8_ref.SCALE_BYTES)
    out = torch.full(shape, -1, dtype=torch.int8, device=DEVICE)
    if slots:
        owned = torch.cat(slots)
        out[owned] = twin(cache[owned]).view(torch.int8)
    return out.view(pool)


def rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A pool's rows at ``slots`` as the oracle reads them (a quantized pool's dequantized)."""
    from asyncengine.kernels.reference import kv_int8_ref

    if cache.dtype in kv_int8_ref.SCALED_POOLS:
        return kv_int8_ref.dequantize_kv(cache[slots])
    return cache[slots]


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float):
    """float64 causal attention of q [M, H, D] at positions first_pos.. over k, v [L, Hkv, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    query_pos = torch.arange(q.shape[0], device=q.device)[:, None] + first_pos
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def draw_shape(rng: random.Random) -> tuple[int, int, int, int]:
    group = rng.choice([1, 4, 7])
    kv_heads = rng.choice([1, 2, 4])
    return group, kv_heads, rng.choice([64, 128]), rng.choice([1, 16])


def check_decode(rng: random.Random, dtype: torch.dtype, pool: torch.dtype | None = None) -> float:
    from asyncengine.kernels.triton.triton_decode_attention import decode_attention

    group, kv_heads, head_dim, page_size = draw_shape(rng)
    lengths = [
        rng.choice([rng.randint(1, 64), rng.randint(1, int(5000 * SCALE) + 1)])
        for _ in range(rng.randint(1, 40))
    ]
    kv = paged(lengths, kv_heads, head_dim, page_size, dtype, pool)
    q = torch.randn((len(lengths), kv_heads * group, head_dim), device=DEVICE).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    splits = rng.choice([None, None, 1, 3, 8])
    decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq_lens, page_size, scale,
        num_splits=splits, out=out,
    )  # fmt: skip
    ref = torch.cat(
        [
            oracle(q[b : b + 1], rows(kv.k_cache, s), rows(kv.v_cache, s), n - 1, scale)
            for b, (s, n) in enumerate(zip(kv.slots, lengths, strict=True))
        ]
    )
    return rel_error(out, ref)


def check_extend(rng: random.Random, dtype: torch.dtype, pool: torch.dtype | None = None) -> float:
    from asyncengine.kernels.triton.triton_extend_attention import extend_attention

    group, kv_heads, head_dim, page_size = draw_shape(rng)
    batch = rng.randint(1, 8)
    new = [
        rng.choice([1, rng.randint(1, 40), rng.randint(1, int(700 * SCALE) + 1)])
        for _ in range(batch)
    ]
    prefix = [
        rng.choice([0, rng.randint(0, 40), rng.randint(0, int(2000 * SCALE))]) for _ in range(batch)
    ]
    lengths = [p + n for p, n in zip(prefix, new, strict=True)]
    kv = paged(lengths, kv_heads, head_dim, page_size, dtype, pool)
    q = torch.randn((sum(new), kv_heads * group, head_dim), device=DEVICE).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    extend_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, cu, seq_lens, page_size, scale,
        max_q_len=max(new), out=out,
    )  # fmt: skip
    refs = []
    for b in range(batch):
        mine = slice(int(cu[b]), int(cu[b + 1]))
        refs.append(
            oracle(
                q[mine],
                rows(kv.k_cache, kv.slots[b]),
                rows(kv.v_cache, kv.slots[b]),
                prefix[b],
                scale,
            )
        )
    return rel_error(out, torch.cat(refs))


def check_elementwise(rng: random.Random, dtype: torch.dtype) -> dict[str, float]:
    from asyncengine.kernels.reference import activation_ref, kv_store_ref, norm_ref, rotary_ref
    from asyncengine.kernels.triton.triton_activation import silu_and_mul
    from asyncengine.kernels.triton.triton_kv_store import store_kv
    from asyncengine.kernels.triton.triton_norm import fused_add_rms_norm, rms_norm
    from asyncengine.kernels.triton.triton_rotary import apply_rotary

    rows, hidden = rng.randint(1, 3000), rng.choice([64, 576, 1000, 4096])
    x = torch.randn((rows, hidden), device=DEVICE).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    errors = {
        "rms_norm": rel_error(
            rms_norm(x, weight, 1e-6), norm_ref.rms_norm(x, weight, 1e-6).double()
        )
    }
    y, s = fused_add_rms_norm(x, residual, weight, 1e-6)
    y_ref, s_ref = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    errors["fused_add_rms_norm"] = max(rel_error(y, y_ref.double()), rel_error(s, s_ref.double()))
    gate_up = torch.randn((rows, 2 * rng.choice([96, 1536, 5000])), device=DEVICE).to(dtype)
    errors["silu_and_mul"] = rel_error(
        silu_and_mul(gate_up), activation_ref.silu_and_mul(gate_up).double()
    )

    group, kv_heads, head_dim, _ = draw_shape(rng)
    tokens = rng.randint(1, 2000)
    qkv = torch.randn((tokens, (group + 2) * kv_heads * head_dim), device=DEVICE).to(dtype)
    q = qkv[:, : group * kv_heads * head_dim].view(tokens, group * kv_heads, head_dim)
    k = qkv[:, group * kv_heads * head_dim : (group + 1) * kv_heads * head_dim].view(
        tokens, kv_heads, head_dim
    )
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    angles = torch.rand((4096, head_dim // 2), device=DEVICE) * 6.3
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q_ref, k_ref = rotary_ref.apply_rotary(q.clone(), k.clone(), positions, cache)
    q_out, k_out = apply_rotary(q, k, positions, cache)  # strided views of one QKV tensor
    errors["apply_rotary"] = max(rel_error(q_out, q_ref.double()), rel_error(k_out, k_ref.double()))

    slots = torch.randperm(3 * tokens, device=DEVICE)[:tokens]
    k_cache = torch.randn((3 * tokens, kv_heads, head_dim), device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    v = torch.randn_like(k)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store_ref.store_kv(want_k, want_v, k, v, slots)
    store_kv(k_cache, v_cache, k, v, slots)
    errors["store_kv"] = max(
        rel_error(k_cache, want_k.double()), rel_error(v_cache, want_v.double())
    )
    return errors


def check_quantized_stores(rng: random.Random, dtype: torch.dtype, pool: torch.dtype) -> float:
    """The fraction of pool bytes where store_kv and rotary_store differ from the torch twins'
    quantization (of the rows themselves; of the rows rotary_store writes into a float pool)."""
    from asyncengine.kernels.reference import kv_fp8_ref, kv_int8_ref
    from asyncengine.kernels.triton.triton_kv_store import store_kv
    from asyncengine.kernels.triton.triton_rotary_store import rotary_store

    twin = kv_int8_ref.quantize_kv if pool == torch.int8 else kv_fp8_ref.quantize_kv_fp8
    group, kv_heads, head_dim, _ = draw_shape(rng)
    heads, tokens = group * kv_heads, rng.randint(1, int(2000 * SCALE) + 1)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), device=DEVICE)
    qkv = (qkv * torch.rand((tokens, 1), device=DEVICE) * 20).to(dtype)
    kv_size = kv_heads * head_dim
    k = qkv[:, heads * head_dim : heads * head_dim + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, heads * head_dim + kv_size :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(2 * tokens, device=DEVICE)[:tokens]
    empty = quantized(torch.zeros((2 * tokens, kv_heads, head_dim), device=DEVICE), [], pool)
    k_cache, v_cache = empty.clone(), empty.clone()
    store_kv(k_cache, v_cache, k, v, slots)
    differ = (k_cache[slots].view(torch.int8) != twin(k).view(torch.int8)).float().mean()
    differ += (v_cache[slots].view(torch.int8) != twin(v).view(torch.int8)).float().mean()

    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    angles = torch.rand((4096, head_dim // 2), device=DEVICE) * 6.3
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    float_k = torch.zeros((2 * tokens, kv_heads, head_dim), dtype=dtype, device=DEVICE)
    float_v = torch.zeros_like(float_k)
    rotary_store(qkv.clone(), heads, kv_heads, positions, cache, float_k, float_v, slots)
    k_cache, v_cache = empty.clone(), empty.clone()
    rotary_store(qkv, heads, kv_heads, positions, cache, k_cache, v_cache, slots)
    for got, stored in ((k_cache, float_k), (v_cache, float_v)):
        want = twin(stored[slots]).view(torch.int8)
        differ += (got[slots].view(torch.int8) != want).float().mean()
    return float(differ)


def pools_here() -> tuple[torch.dtype, ...]:
    """The quantized pools the device reads: fp8 from compute capability 8.9."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return POOLS[:1]
    return POOLS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60, help="random cases per kernel and dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny lengths on CPU under TRITON_INTERPRET=1 (fp32 only): checks this script",
    )
    args = parser.parse_args(argv)
    global DEVICE, SCALE, DTYPES
    if args.cpu_dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton picks the interpreter when it wraps the kernels, at import: too late to set here
        raise ValueError("--cpu-dry-run runs under the Triton interpreter: set TRITON_INTERPRET=1")
    if args.cpu_dry_run:
        DEVICE, SCALE, DTYPES = "cpu", 0.02, (torch.float32,)
    elif not torch.cuda.is_available():
        print("check_kernels_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    worst: dict[tuple[str, torch.dtype], float] = defaultdict(float)
    counts: dict[tuple[str, torch.dtype], int] = defaultdict(int)
    failures: list[str] = []
    limits: dict[tuple[str, torch.dtype], float] = {}

    def record(
        name: str, dtype: torch.dtype, error: float, case: int, limit: float | None = None
    ) -> None:
        key = (name, dtype)
        worst[key] = max(worst[key], error)
        counts[key] += 1
        limits[key] = LIMITS[dtype] if limit is None else limit
        if not error <= limits[key]:
            failures.append(f"{name} {dtype} case {case}: relative error {error:.2e}")

    for case in range(args.cases):
        # half the cases in bf16, the engine's GPU dtype; the rest split between fp16 and fp32
        for dtype in DTYPES if case % 2 == 0 else DTYPES[:1]:
            record("decode_attention", dtype, check_decode(rng, dtype), case)
            record("extend_attention", dtype, check_extend(rng, dtype), case)
            for name, error in check_elementwise(rng, dtype).items():
                record(name, dtype, error, case)
            for pool in pools_here() if dtype in POOL_ACTIVATIONS else ():
                tag = "int8" if pool == torch.int8 else "fp8"
                record(f"decode_attention/{tag}", dtype, check_decode(rng, dtype, pool), case)
                record(f"extend_attention/{tag}", dtype, check_extend(rng, dtype, pool), case)
                error = check_quantized_stores(rng, dtype, pool)
                record(f"stores/{tag} (bytes)", dtype, error, case, limit=0.0)
        print(f"case {case}: {len(failures)} failures so far", flush=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"{'kernel':<22} {'dtype':<16} {'cases':>5} {'worst rel err':>14} {'limit':>8}")
    for (name, dtype), error in sorted(
        worst.items(), key=lambda item: (item[0][0], str(item[0][1]))
    ):
        print(
            f"{name:<22} {str(dtype):<16} {counts[(name, dtype)]:>5} {error:>14.2e} {limits[(name, dtype)]:>8.0e}"
        )
    for line in failures[:20]:
        print("FAIL", line)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
