"""The host buffer's page copies: cut into runs of consecutive pages, they move the same bytes
as copying page by page, whatever the page lists (scattered, consecutive, both in one plan)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.common.plan import SwapCopy
from asyncengine.executor.host_kv_buffer import HostKVBuffer, page_runs
from asyncengine.executor.kv_pool import KVPool

POOL_PAGES, HOST_PAGES, PAGE = 12, 16, 4


def make_buffer(dtype: torch.dtype) -> HostKVBuffer:
    pool = KVPool(2, 2, 8, POOL_PAGES, PAGE, dtype=dtype)
    pool.k.copy_(torch.randn(pool.k.shape).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape).to(dtype))
    buffer = HostKVBuffer(pool, HOST_PAGES)
    buffer.k.copy_(torch.randn(buffer.k.shape).to(dtype))
    buffer.v.copy_(torch.randn(buffer.v.shape).to(dtype))
    return buffer


def page_by_page(buffer: HostKVBuffer, out: list[SwapCopy], into: list[SwapCopy]) -> list:
    """What the copies must leave: each page copied on its own, outs before ins."""
    pool_k, pool_v = (buffer._pages(t).clone() for t in (buffer.pool.k, buffer.pool.v))
    host_k, host_v = (buffer._pages(t).clone() for t in (buffer.k, buffer.v))
    for copy in out:
        for pool_page, host_page in zip(copy.pool_pages, copy.host_pages, strict=True):
            host_k[:, host_page] = pool_k[:, pool_page]
            host_v[:, host_page] = pool_v[:, pool_page]
    for copy in into:
        for pool_page, host_page in zip(copy.pool_pages, copy.host_pages, strict=True):
            pool_k[:, pool_page] = host_k[:, host_page]
            pool_v[:, pool_page] = host_v[:, host_page]
    return [pool_k, pool_v, host_k, host_v]


def split(pairs: list[tuple[int, int]], cuts: list[int]) -> list[SwapCopy]:
    """``pairs`` (pool page, host page) as several copies, cut at ``cuts``."""
    bounds = sorted({0, len(pairs), *(c % (len(pairs) + 1) for c in cuts)})
    return [
        SwapCopy([p for p, _ in pairs[a:b]], [h for _, h in pairs[a:b]])
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    ]


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[SwapCopy], list[SwapCopy]]:
    """A plan's copies: outs to distinct host pages, ins to distinct pool pages; an in may
    read a host page the same plan writes and write a pool page the same plan reads."""
    consecutive = draw(st.booleans())
    n_out = draw(st.integers(0, 6))
    n_in = draw(st.integers(0, 6))
    if consecutive:
        pool_start = draw(st.integers(0, POOL_PAGES - n_out))
        host_start = draw(st.integers(0, HOST_PAGES - n_out))
        out_pool = list(range(pool_start, pool_start + n_out))
        out_host = list(range(host_start, host_start + n_out))
    else:
        out_pool = draw(st.lists(st.integers(0, POOL_PAGES - 1), min_size=n_out, max_size=n_out))
        out_host = draw(st.permutations(range(HOST_PAGES)))[:n_out]
    in_pool = draw(st.permutations(range(POOL_PAGES)))[:n_in]
    in_host = draw(st.lists(st.integers(0, HOST_PAGES - 1), min_size=n_in, max_size=n_in))
    cuts = draw(st.lists(st.integers(0, 12), max_size=3))
    out = split(list(zip(out_pool, out_host, strict=True)), cuts)
    into = split(list(zip(in_pool, in_host, strict=True)), cuts)
    return out, into


@settings(max_examples=150, deadline=None)
@given(plan=plans(), half=st.booleans())
def test_runs_copy_what_page_by_page_copies(
    plan: tuple[list[SwapCopy], list[SwapCopy]], half: bool
) -> None:
    out, into = plan
    buffer = make_buffer(torch.bfloat16 if half else torch.float32)
    expected = page_by_page(buffer, out, into)
    buffer.run(out, into)
    got = [buffer._pages(t) for t in (buffer.pool.k, buffer.pool.v, buffer.k, buffer.v)]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30, unique_by=lambda p: p[1]
    )
)
def test_page_runs_cover_every_pair_once(pairs: list[tuple[int, int]]) -> None:
    runs = page_runs([[s for s, _ in pairs]], [[d for _, d in pairs]])
    covered = [(s + i, d + i) for s, d, count in runs for i in range(count)]
    assert sorted(covered) == sorted(pairs)
    assert all(count >= 1 for _, _, count in runs)


def test_a_requests_consecutive_pages_are_one_run() -> None:
    assert page_runs([[7, 8, 9], [10, 11]], [[3, 4, 5], [6, 7]]) == [(7, 3, 5)]
    assert page_runs([[9, 7, 8]], [[5, 3, 4]]) == [(7, 3, 3)]
    assert page_runs([[1, 2, 3]], [[5, 6, 9]]) == [(1, 5, 2), (3, 9, 1)]
    assert page_runs([], []) == []
