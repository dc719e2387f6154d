"""The native SiLU-and-mul at real models' MLP widths: its gate and up halves are rows of their
own, so a gate_up row wider than the kernel's row buffer (Qwen2.5-1.5B's MLP of 8960: 17,920
values; Llama-3.1-8B's 14,336) is taken; an MLP wider than the buffer is refused clearly."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.reference import activation_ref
from tests.native_support import needs_native

pytestmark = needs_native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [8960, 14336, 8969], ids=["8960", "14336", "odd"])
def test_silu_and_mul_at_real_mlp_widths(dtype: torch.dtype, inter: int) -> None:
    from asyncengine.kernels.cpu import layer_ops_native as native

    gate_up = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(
        dtype
    )
    got, want = native.silu_and_mul(gate_up), activation_ref.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # the same roundings after the same operations
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_refuses_an_mlp_wider_than_its_rows() -> None:
    from asyncengine.kernels.cpu import layer_ops_native as native

    with pytest.raises(ValueError, match="exceed"):
        native.silu_and_mul(torch.zeros(1, 2 * (native.MAX_ROW + 16)))
