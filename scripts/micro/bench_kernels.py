"""Benchmark the Triton kernels on a CUDA GPU: correctness against the torch references, then
median time and how close each kernel comes to the machine's measured ceilings.

    python scripts/micro/bench_kernels.py [--only decode,extend] [--json results.json]

Memory-bound kernels report the fraction of the measured device-to-device copy bandwidth;
attention also reports TFLOP/s and the ratio to torch SDPA on contiguous K/V. Targets: decode at
batch 64, context 4096, GQA 4, head_dim 128, bf16 >= 70% of copy bandwidth; extend within 1.5x
of torch SDPA's flash path. Exits with a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncengine.script_main import run_main

DTYPE = torch.bfloat16
DECODE_TARGET = 0.70  # of copy bandwidth
EXTEND_TARGET = 1.5  # x torch SDPA flash


@dataclass(slots=True)
class Result:
    kernel: str
    shape: str
    rel_error: float
    ms: float
    gbps: float | None = None
    bandwidth_fraction: float | None = None
    tflops: float | None = None
    sdpa_ms: float | None = None
    note: str = ""


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("nan")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def measure_copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(256 * 1024 * 1024, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def measure_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


# --- inputs ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int


def paged_kv(batch: int, context: int, num_kv_heads: int, head_dim: int, page_size: int) -> Paged:
    """Every request owns ``context`` tokens on pages shuffled across the pool."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    order = torch.randperm(num_pages, device="cuda").to(torch.int32)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    return Paged(
        k_cache=torch.randn(shape, device="cuda", dtype=DTYPE),
        v_cache=torch.randn(shape, device="cuda", dtype=DTYPE),
        block_table=order.view(batch, pages_per_seq),
        seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
        page_size=page_size,
    )


def contiguous_kv(kv: Paged, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V gathered into [B, Hkv, L, D] for torch SDPA."""
    pos = torch.arange(context, device="cuda")
    slots = kv.block_table.long()[:, pos // kv.page_size] * kv.page_size + pos % kv.page_size
    k = kv.k_cache[slots.reshape(-1)].view(batch, context, *kv.k_cache.shape[1:])
    v = kv.v_cache[slots.reshape(-1)].view(batch, context, *kv.v_cache.shape[1:])
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


# --- benchmarks --------------------------------------------------------------------------------


def bench_decode(
    copy_gbps: float, batch: int, context: int, heads: int, kv_heads: int, head_dim: int = 128
) -> Result:
    import torch.nn.functional as F

    from asyncengine.kernels.reference import attention_ref
    from asyncengine.kernels.triton.triton_decode_attention import decode_attention

    kv = paged_kv(batch, context, kv_heads, head_dim, page_size=16)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=DTYPE)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, kv.page_size, scale)
    out = torch.full_like(q, float("nan"))
    decode_attention(*args, out=out)
    err = rel_error(out, attention_ref.decode_attention(*args))
    ms = median_ms(lambda: decode_attention(*args, out=out))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * DTYPE.itemsize
    gbps = (kv_bytes + 2 * q.nbytes) / (ms * 1e-3) / 1e9
    k, v = contiguous_kv(kv, batch, context)
    qs = q.unsqueeze(2)
    sdpa_ms = median_ms(
        lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=heads != kv_heads)
    )
    fraction = gbps / copy_gbps
    note = ""
    if (batch, context, heads // kv_heads, head_dim) == (64, 4096, 4, 128):
        note = f"target >= {DECODE_TARGET:.0%}: {'met' if fraction >= DECODE_TARGET else 'MISSED'}"
    return Result(
        "decode_attention",
        f"B={batch} ctx={context} H={heads} Hkv={kv_heads} D={head_dim}",
        err,
        ms,
        gbps=gbps,
        bandwidth_fraction=fraction,
        tflops=4 * batch * heads * context * head_dim / (ms * 1e-3) / 1e12,
        sdpa_ms=sdpa_ms,
        note=note,
    )


def bench_extend(
    batch: int, prefix: int, new: int, heads: int, kv_heads: int, head_dim: int = 128
) -> Result:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from asyncengine.kernels.reference import attention_ref
    from asyncengine.kernels.triton.triton_extend_attention import extend_attention

    total = prefix + new
    kv = paged_kv(batch, total, kv_heads, head_dim, page_size=16)
    q = torch.randn(batch * new, heads, head_dim, device="cuda", dtype=DTYPE)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, cu, kv.seq_lens, kv.page_size, scale)
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, max_q_len=new, out=out)
    err = rel_error(out, attention_ref.extend_attention(*args))
    ms = median_ms(lambda: extend_attention(*args, max_q_len=new, out=out))
    # Visible (query, key) pairs: the whole prefix plus the causal triangle.
    pairs = batch * (new * prefix + new * (new + 1) / 2)
    flops = 4 * pairs * heads * head_dim

    sdpa_ms: float | None = None
    note = ""
    if prefix == 0:  # the flash path takes is_causal only for square attention
        k, v = contiguous_kv(kv, batch, total)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qs = q.view(batch, new, heads, head_dim).transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_ms = median_ms(
                lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
            )
        ratio = ms / sdpa_ms
        verdict = "met" if ratio <= EXTEND_TARGET else "MISSED"
        note = f"{ratio:.2f}x SDPA flash (target <= {EXTEND_TARGET}x): {verdict}"
    return Result(
        "extend_attention",
        f"B={batch} prefix={prefix} new={new} H={heads} Hkv={kv_heads} D={head_dim}",
        err,
        ms,
        tflops=flops / (ms * 1e-3) / 1e12,
        sdpa_ms=sdpa_ms,
        note=note,
    )


def bench_memory_bound(
    name: str,
    shape: str,
    run: Callable[[], object],
    check: Callable[[], float],
    nbytes: int,
    copy_gbps: float,
) -> Result:
    err = check()
    ms = median_ms(run)
    gbps = nbytes / (ms * 1e-3) / 1e9
    return Result(name, shape, err, ms, gbps=gbps, bandwidth_fraction=gbps / copy_gbps)


def bench_elementwise(copy_gbps: float) -> list[Result]:
    from asyncengine.kernels.reference import activation_ref, kv_store_ref, norm_ref, rotary_ref
    from asyncengine.kernels.triton.triton_activation import silu_and_mul
    from asyncengine.kernels.triton.triton_kv_store import store_kv
    from asyncengine.kernels.triton.triton_norm import fused_add_rms_norm, rms_norm
    from asyncengine.kernels.triton.triton_rotary import apply_rotary

    results = []
    rows, hidden = 16384, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=DTYPE)
    results.append(
        bench_memory_bound(
            "rms_norm",
            f"{rows}x{hidden}",
            lambda: rms_norm(x, weight, 1e-6),
            lambda: rel_error(rms_norm(x, weight, 1e-6), norm_ref.rms_norm(x, weight, 1e-6)),
            2 * x.nbytes,
            copy_gbps,
        )
    )

    def fused_error() -> float:
        y, s = fused_add_rms_norm(x, residual, weight, 1e-6)
        y_ref, s_ref = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-6)
        return max(rel_error(y, y_ref), rel_error(s, s_ref))

    results.append(
        bench_memory_bound(
            "fused_add_rms_norm",
            f"{rows}x{hidden}",
            lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
            fused_error,
            4 * x.nbytes,
            copy_gbps,
        )
    )

    intermediate = 14336
    gate_up = torch.randn(8192, 2 * intermediate, device="cuda", dtype=DTYPE)
    results.append(
        bench_memory_bound(
            "silu_and_mul",
            f"8192x{2 * intermediate}",
            lambda: silu_and_mul(gate_up),
            lambda: rel_error(silu_and_mul(gate_up), activation_ref.silu_and_mul(gate_up)),
            gate_up.nbytes * 3 // 2,
            copy_gbps,
        )
    )

    tokens, heads, kv_heads, head_dim = 16384, 32, 8, 128
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=DTYPE)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    angles = torch.rand(8192, head_dim // 2, device="cuda") * 6.3
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)

    def rotary_error() -> float:
        q_ref, k_ref = rotary_ref.apply_rotary(q, k, positions, cache)
        q_out, k_out = apply_rotary(q.clone(), k.clone(), positions, cache)
        return max(rel_error(q_out, q_ref), rel_error(k_out, k_ref))

    results.append(
        bench_memory_bound(
            "apply_rotary (in place)",
            f"N={tokens} H={heads} Hkv={kv_heads} D={head_dim}",
            lambda: apply_rotary(q, k, positions, cache),
            rotary_error,
            2 * (q.nbytes + k.nbytes),
            copy_gbps,
        )
    )

    slots = torch.randperm(4 * tokens, device="cuda")[:tokens]
    k_cache = torch.zeros(4 * tokens, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    v = torch.randn_like(k)

    def store_error() -> float:
        want_k, want_v = k_cache.clone(), v_cache.clone()
        kv_store_ref.store_kv(want_k, want_v, k, v, slots)
        store_kv(k_cache, v_cache, k, v, slots)
        return max(rel_error(k_cache, want_k), rel_error(v_cache, want_v))

    results.append(
        bench_memory_bound(
            "store_kv",
            f"N={tokens} Hkv={kv_heads} D={head_dim}",
            lambda: store_kv(k_cache, v_cache, k, v, slots),
            store_error,
            4 * k.nbytes,
            copy_gbps,
        )
    )
    return results


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[Result]) -> None:
    header = f"{'kernel':<24} {'shape':<44} {'rel err':>8} {'ms':>8} {'GB/s':>7} {'of copy':>7} {'TFLOP/s':>8} {'SDPA ms':>8}  note"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.kernel:<24} {r.shape:<44} {r.rel_error:>8.1e} {r.ms:>8.3f} "
            f"{fmt(r.gbps, '7.0f'):>7} {fmt(r.bandwidth_fraction, '7.0%'):>7} "
            f"{fmt(r.tflops, '8.1f'):>8} {fmt(r.sdpa_ms, '8.3f'):>8}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="decode,extend,elementwise")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_kernels: no CUDA device here. The Triton kernels are benchmarked on a GPU; on "
            "CPU their correctness is tested under TRITON_INTERPRET=1 "
            "(pytest tests/kernels/test_triton_kernels.py).",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench_kernels: unset TRITON_INTERPRET to time compiled kernels", file=sys.stderr)
        return 2
    only = set(args.only.split(","))
    torch.manual_seed(0)
    copy_gbps = measure_copy_bandwidth()
    matmul_tflops = measure_matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}")
    print(
        f"copy bandwidth {copy_gbps:.0f} GB/s (read + write); bf16 matmul {matmul_tflops:.0f} TFLOP/s"
    )

    results: list[Result] = []
    if "decode" in only:
        for batch, context, heads, kv_heads in [
            (64, 4096, 32, 8),
            (1, 32768, 32, 8),
            (8, 8192, 32, 8),
            (256, 1024, 32, 8),
            (64, 4096, 28, 4),
        ]:
            results.append(bench_decode(copy_gbps, batch, context, heads, kv_heads))
            torch.cuda.empty_cache()
    if "extend" in only:
        for batch, prefix, new, heads, kv_heads in [
            (4, 0, 4096, 32, 8),
            (16, 0, 1024, 32, 8),
            (4, 4096, 1024, 32, 8),
        ]:
            results.append(bench_extend(batch, prefix, new, heads, kv_heads))
            torch.cuda.empty_cache()
    if "elementwise" in only:
        results.extend(bench_elementwise(copy_gbps))

    print_table(results)
    bad = [r for r in results if not r.rel_error < 1e-2]
    if args.json is not None:
        payload = {
            "device": torch.cuda.get_device_name(),
            "copy_gbps": copy_gbps,
            "matmul_tflops": matmul_tflops,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    if bad:
        print(f"INCORRECT: {', '.join(r.kernel for r in bad)} (relative error >= 1e-2)")
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
