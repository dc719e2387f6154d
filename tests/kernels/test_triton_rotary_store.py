"""The fused rotary + KV store Triton kernel against the two kernels it replaces' references
(``apply_rotary`` then ``store_kv``), under the Triton interpreter (CPU), float32, tiny shapes,
and compiled for sm_90 without a GPU. The whole tiny model through it (the Triton backend's
``attend`` after the fused store) is tests/executor/test_triton_model.py's."""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import textwrap

import pytest
import torch

from asyncengine.kernels.reference import kv_store_ref, rotary_ref
from asyncengine.kernels.triton.triton_rotary_store import rotary_store
from tests.python_subprocess import run_python


def rope_cache(max_pos: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    angles = torch.rand((max_pos, head_dim // 2), generator=gen) * 6.3
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 3, 1, 64), (5, 9, 3, 64), (4, 4, 4, 32), (3, 6, 2, 128)],
)
def test_rotary_store_matches_rotary_then_store(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 31 + head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen)
    cos_sin = rope_cache(200, head_dim, gen)
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    num_slots = 32
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[0] = -1  # a padding row: rotated, stored nowhere
    k_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()

    q_ref, k_ref = rotary_ref.apply_rotary(
        qkv[:, :q_size].view(num_tokens, num_heads, head_dim).clone(),
        qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim).clone(),
        positions,
        cos_sin,
    )
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim).clone()
    keep = slots >= 0
    kv_store_ref.store_kv(k_ref_cache, v_ref_cache, k_ref[keep], v[keep], slots[keep])
    k_before = qkv[:, q_size : q_size + kv_size].clone()

    q = rotary_store(qkv, num_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slots)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place, a view of qkv
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, k_ref_cache, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(), v_ref_cache.nan_to_num())
    assert torch.equal(qkv[:, q_size : q_size + kv_size], k_before)  # keys left in qkv


def test_rotary_store_refuses_a_qkv_of_the_wrong_width() -> None:
    k_cache = torch.zeros((4, 1, 64))
    with pytest.raises(ValueError, match="does not hold"):
        rotary_store(
            torch.zeros((2, 64 * 3 + 1)),
            1,
            1,
            torch.zeros(2, dtype=torch.int64),
            torch.zeros((8, 64)),
            k_cache,
            k_cache.clone(),
            torch.zeros(2, dtype=torch.int64),
        )


def test_the_triton_backend_takes_the_fused_kernel() -> None:
    from asyncengine.executor.attention.selector import kernel_ops

    assert kernel_ops("triton").rotary_store is rotary_store
    assert kernel_ops("flashinfer").rotary_store is None  # FlashInfer stores K/V its own way


_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import warnings
    warnings.filterwarnings("ignore")
    from asyncengine.kernels.triton.triton_rotary_store import _rotary_store_kernel
    from tests.triton_sm90 import compile_for_sm90

    compile_for_sm90(
        _rotary_store_kernel,
        dict(HEAD_DIM=64, HALF=32, BLOCK_HQ=16, BLOCK_HK=4, BLOCK_HALF=32, QUANTIZED=False),
    )
    """
)


@pytest.mark.slow
def test_the_fused_kernel_compiles_for_sm90() -> None:
    """Triton's own compiler and ptxas build it for an H100/H200 without a GPU."""
    assert "compiled" in run_python(_COMPILE_FOR_SM90, timeout=300)
