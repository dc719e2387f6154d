"""Batched LoRA kernels against the torch reference: the native CPU kernel (float32 and
bfloat16 rows, runs of rows, block-diagonal B of a fused projection) and the Triton kernels under
the interpreter (float32, tiny shapes)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton loads (tests/conftest.py sets it too)

import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu import lora_native
from asyncengine.kernels.reference.lora_ref import lora_apply_ref, segments_of


def _fused(
    gen: torch.Generator, in_features: int, parts: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """A and block-diagonal B of a fused projection whose parts are (out, rank); rank 0: the
    part is not targeted."""
    total_rank = sum(r for _, r in parts)
    out_total = sum(o for o, _ in parts)
    a = torch.randn(total_rank, in_features, generator=gen)
    b = torch.zeros(out_total, total_rank)
    slices = []
    o = r = 0
    for out, rank in parts:
        if rank:
            b[o : o + out, r : r + rank] = torch.randn(out, rank, generator=gen)
            slices.append((o, o + out, r, r + rank))
        o += out
        r += rank
    return a, b, tuple(slices)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_native_kernel_matches_reference(
    dtype: torch.dtype, weights: torch.dtype, seed: int
) -> None:
    assert lora_native.available()
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n, in_features = int(rng.integers(1, 40)), int(rng.choice([8, 64, 67, 576]))
    parts = [(int(rng.integers(1, 50)), int(rng.choice([0, 1, 4, 16]))) for _ in range(3)]
    if not any(r for _, r in parts):
        parts[0] = (parts[0][0], 8)
    a, b, slices = _fused(gen, in_features, parts)
    a, b = a.to(weights), b.to(weights)
    x = torch.randn(n, in_features, generator=gen).to(dtype)
    y = torch.randn(n, b.shape[0], generator=gen).to(dtype)
    rows = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
    segments = np.array(segments_of(rows), dtype=np.int64).reshape(-1, 2)
    want = y.clone()
    lora_apply_ref(want, x, torch.tensor(rows), a, b)
    got = y.clone()
    bt = b.t().contiguous()
    lora_native.lora_apply(
        got, x, segments, torch.tensor(rows), a, bt, lora_native.slices_array(slices)
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    untouched = sorted(set(range(n)) - set(rows))
    assert torch.equal(got[untouched], y[untouched])


def test_native_kernel_on_strided_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    a, b, slices = _fused(gen, 32, [(24, 8)])
    x = torch.randn(6, 40, generator=gen)[:, :32]  # rows 40 apart
    y_full = torch.randn(6, 30, generator=gen)
    y = y_full[:, :24]
    rows = torch.tensor([1, 2, 4])
    want = y.clone()
    lora_apply_ref(want, x, rows, a, b)
    segments = np.array([[1, 3], [4, 5]], dtype=np.int64)
    bt = b.t().contiguous()
    lora_native.lora_apply(y, x, segments, rows, a, bt, lora_native.slices_array(slices))
    assert torch.allclose(y, want, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_triton_kernels_match_reference(seed: int) -> None:
    from asyncengine.kernels.triton.triton_lora import lora_apply

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n, in_features = int(rng.integers(1, 9)), int(rng.choice([16, 70]))
    a, b, _ = _fused(gen, in_features, [(int(rng.integers(3, 80)), int(rng.choice([1, 4, 20])))])
    x = torch.randn(n, in_features, generator=gen)
    y = torch.randn(n, b.shape[0], generator=gen)
    rows = torch.tensor(sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)))
    want = y.clone()
    lora_apply_ref(want, x, rows, a, b)
    got = y.clone()
    lora_apply(got, x, rows, a, b)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


_COMPILE_FOR_SM90 = """
import warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asyncengine.kernels.triton import triton_lora

POINTERS = {"rows_ptr": "*i64", "t_ptr": "*fp32", "a_ptr": "*bf16", "b_ptr": "*bf16"}
for kernel, constants in (
    (triton_lora._lora_shrink_kernel, {"BLOCK_R": 16, "BLOCK_K": 64}),
    (triton_lora._lora_expand_kernel, {"BLOCK_R": 64, "BLOCK_OUT": 64}),
):
    signature = {
        name: "constexpr" if name in constants else POINTERS.get(name, "*bf16")
        if name.endswith("_ptr") else "i32"
        for name in kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "num_stages": 2},
    )
    assert compiled.asm["ptx"]
    print("compiled", kernel.__name__)
"""


@pytest.mark.slow
def test_triton_lora_kernels_compile_for_sm90() -> None:
    """Triton's own compiler and ptxas build the LoRA kernels for an H100 without a GPU."""
    from tests.python_subprocess import run_python

    stdout = run_python(_COMPILE_FOR_SM90, env={}, timeout=300)
    assert stdout.count("compiled") == 2, stdout
