"""The native page-run copy against the torch slice copy: same bytes, float32, bfloat16 and int8, pages of
different layer strides (the pool and a larger host buffer)."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import page_copy_native
from asyncengine.kernels.cpu.page_copy_native import copy_page_runs, copy_page_runs_ref

pytestmark = pytest.mark.skipif(
    not page_copy_native.available(), reason="no C compiler for the native CPU kernels"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_runs_copy_what_torch_copies(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    pool = (torch.randn(3, 10, 4, 2, 8, generator=generator) * 50).to(dtype)
    host = (torch.randn(3, 17, 4, 2, 8, generator=generator) * 50).to(dtype)
    runs = [(0, 5, 3), (9, 0, 2), (14, 9, 1)]  # (host page, pool page, pages)
    original_pool = pool.clone()
    want_pool, want_host = pool.clone(), host.clone()
    copy_page_runs_ref(want_pool, host, runs)
    copy_page_runs_ref(want_host, pool, [(d, s, n) for s, d, n in runs])
    copy_page_runs(pool, host, runs)
    copy_page_runs(host, original_pool, [(d, s, n) for s, d, n in runs])
    assert torch.equal(pool, want_pool)
    assert torch.equal(host, want_host)


def test_one_long_run_over_many_layers() -> None:
    pool = torch.randn(8, 64, 16, 3, 64)
    host = torch.zeros(8, 96, 16, 3, 64)
    runs = [(0, 32, 64)]
    copy_page_runs(host, pool, runs)
    assert torch.equal(host[:, 32:], pool)
    assert not host[:, :32].any()


def test_pages_that_are_not_whole_blocks_take_the_torch_path() -> None:
    pool = torch.randn(2, 6, 4, 8)[:, :, :, :4]  # each page strided: not one block of bytes
    host = torch.zeros(2, 6, 4, 4)
    copy_page_runs(host, pool, [(1, 2, 3)])
    assert torch.equal(host[:, 2:5], pool[:, 1:4])
