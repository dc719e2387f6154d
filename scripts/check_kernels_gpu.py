"""Correctness sweep of the compiled Triton attention kernels on a CUDA GPU.

The unit tests run the kernels under the Triton interpreter on tiny shapes; this runs the
compiled kernels on random ragged batches of realistic lengths against a float64 oracle written
here (one request at a time, no paging tricks): page sizes 1 and 16, GQA ratios 1, 3, 4 and 7,
head dims 64 and 128, bf16 / fp16 / fp32, forced split counts, prefixes that end mid-page.
Pool slots no request owns hold NaN, so a kernel that reads a key it should not see fails.

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
DEVICE = "cuda"
SCALE = 1.0  # lengths shrink by this (a CPU dry run under the interpreter)


@dataclass(slots=True)
class Paged:
    k_cache: torch.Tensor  # [S, Hkv, D], NaN where no request owns the slot
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, P] int32
    slots: list[torch.Tensor]  # each request's token slots, in position order


def paged(
    lengths: list[int], kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
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
    return Paged(k_cache, v_cache, table, slots)


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


def check_decode(rng: random.Random, dtype: torch.dtype) -> float:
    from asyncengine.kernels.triton.triton_decode_attention import decode_attention

    group, kv_heads, head_dim, page_size = draw_shape(rng)
    lengths = [
        rng.choice([rng.randint(1, 64), rng.randint(1, int(5000 * SCALE) + 1)])
        for _ in range(rng.randint(1, 40))
    ]
    kv = paged(lengths, kv_heads, head_dim, page_size, dtype)
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
            oracle(q[b : b + 1], kv.k_cache[s], kv.v_cache[s], n - 1, scale)
            for b, (s, n) in enumerate(zip(kv.slots, lengths, strict=True))
        ]
    )
    return rel_error(out, ref)


def check_extend(rng: random.Random, dtype: torch.dtype) -> float:
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
    kv = paged(lengths, kv_heads, head_dim, page_size, dtype)
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
        rows = slice(int(cu[b]), int(cu[b + 1]))
        refs.append(
            oracle(q[rows], kv.k_cache[kv.slots[b]], kv.v_cache[kv.slots[b]], prefix[b], scale)
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

    def record(name: str, dtype: torch.dtype, error: float, case: int) -> None:
        key = (name, dtype)
        worst[key] = max(worst[key], error)
        counts[key] += 1
        if not error <= LIMITS[dtype]:
            failures.append(f"{name} {dtype} case {case}: relative error {error:.2e}")

    for case in range(args.cases):
        # half the cases in bf16, the engine's GPU dtype; the rest split between fp16 and fp32
        for dtype in DTYPES if case % 2 == 0 else DTYPES[:1]:
            record("decode_attention", dtype, check_decode(rng, dtype), case)
            record("extend_attention", dtype, check_extend(rng, dtype), case)
            for name, error in check_elementwise(rng, dtype).items():
                record(name, dtype, error, case)
        print(f"case {case}: {len(failures)} failures so far", flush=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"{'kernel':<22} {'dtype':<16} {'cases':>5} {'worst rel err':>14} {'limit':>8}")
    for (name, dtype), error in sorted(
        worst.items(), key=lambda item: (item[0][0], str(item[0][1]))
    ):
        print(
            f"{name:<22} {str(dtype):<16} {counts[(name, dtype)]:>5} {error:>14.2e} {LIMITS[dtype]:>8.0e}"
        )
    for line in failures[:20]:
        print("FAIL", line)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    run_main(main)
