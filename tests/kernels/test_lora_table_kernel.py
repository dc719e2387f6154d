"""The LoRA kernel's table call (cpu_lora.c's asyncengine_lora_apply_table): every adapter's
rows of one projection in one call, against the torch reference per adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.kernels.cpu import lora_native
from asyncengine.kernels.cpu.decode_step_lora import TARGETS, AdapterTable, StepLora
from asyncengine.kernels.reference.lora_ref import lora_apply_ref
from tests.kernels.test_lora_kernels import _fused

SLOT = 1 * TARGETS + 2  # layer 1's gate_up: the other slots of the table stay empty


def _table(
    gen: torch.Generator, in_features: int, parts: list[tuple[int, int]], weights: torch.dtype
) -> tuple[AdapterTable, torch.Tensor, torch.Tensor]:
    a, b, slices = _fused(gen, in_features, parts)
    a, b = a.to(weights), b.to(weights)
    prepared = lora_native.prepare(a, b.t().contiguous(), lora_native.slices_array(slices))
    assert prepared is not None
    layers: list[list[lora_native.PreparedLora | None]] = [[None] * TARGETS for _ in range(2)]
    layers[1][2] = prepared
    return AdapterTable(layers), a, b


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_several_adapters_and_the_base_in_one_call(
    dtype: torch.dtype, weights: torch.dtype, threads: int
) -> None:
    assert lora_native.available()
    gen = torch.Generator().manual_seed(3)
    in_features, out_parts = 256, (48, 48)
    ranks = [(4, 4), (16, 0), (8, 8)]  # the second targets only the gate part
    made = [_table(gen, in_features, list(zip(out_parts, r, strict=True)), weights) for r in ranks]
    n = 120  # enough work (PARALLEL_MIN_WORK) that two threads split the rows
    row_adapter = np.random.default_rng(3).integers(-1, len(made), size=n).astype(np.int32)
    x = torch.randn(n, in_features, generator=gen).to(dtype)
    y = torch.randn(n, sum(out_parts), generator=gen).to(dtype)
    want = y.clone()
    for k, (_, a, b) in enumerate(made):
        rows = torch.from_numpy(np.flatnonzero(row_adapter == k))
        lora_apply_ref(want, x, rows, a, b)
    got = y.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = StepLora([t for t, _, _ in made], row_adapter)
        assert lora_native.apply_table(got, x, step, SLOT, in_features)
        # a slot no adapter fills leaves every row as it was
        assert lora_native.apply_table(got, x, step, 0, in_features)
    finally:
        torch.set_num_threads(before)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    base = row_adapter == -1
    assert torch.equal(got[torch.from_numpy(base)], y[torch.from_numpy(base)])


def test_a_table_of_other_shapes_is_refused_and_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(5)
    table, _, _ = _table(gen, 64, [(32, 8)], torch.float32)
    step = StepLora([table], np.zeros(3, dtype=np.int32))
    x, y = torch.randn(3, 64), torch.randn(3, 40)  # 40 outputs, the update has 32
    before = y.clone()
    with pytest.raises(ValueError, match="64 -> 40"):
        lora_native.apply_table(y, x, step, SLOT, 64)
    assert torch.equal(y, before)
    assert not lora_native.apply_table(y, x[:2], step, SLOT, 64)  # rows not the step's


def test_row_adapters_past_the_tables_are_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    table, _, _ = _table(gen, 64, [(32, 8)], torch.float32)
    with pytest.raises(ValueError, match="past"):
        StepLora([table], np.array([0, 1], dtype=np.int32))


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_past_a_slice_end_and_groups_of_more_rows_than_one_pass(
    dtype: torch.dtype, weights: torch.dtype
) -> None:
    """Widths and inputs not a multiple of the 16-output tile or a vector (the tiles' zero tails,
    the shrink's scalar tail), and an adapter of 7 rows spread over the step (one pass of 4 rows,
    one of 3, in the grouped order)."""
    gen = torch.Generator().manual_seed(7)
    in_features, out_parts = 100, (40, 21)
    made = [
        _table(gen, in_features, list(zip(out_parts, r, strict=True)), weights)
        for r in ((5, 3), (2, 0))
    ]
    row_adapter = np.array([0, -1, 1, 0, 0, 1, 0, -1, 0, 0, 0, 1], dtype=np.int32)
    x = torch.randn(row_adapter.size, in_features, generator=gen).to(dtype)
    y = torch.randn(row_adapter.size, sum(out_parts), generator=gen).to(dtype)
    want = y.clone()
    for k, (_, a, b) in enumerate(made):
        lora_apply_ref(want, x, torch.from_numpy(np.flatnonzero(row_adapter == k)), a, b)
    got = y.clone()
    step = StepLora([t for t, _, _ in made], row_adapter)
    assert lora_native.apply_table(got, x, step, SLOT, in_features)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
