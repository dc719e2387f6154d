"""PageAllocator, PageTable and KVPool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.cache import (
    InvalidFreeError,
    OutOfPagesError,
    OutOfRowsError,
    PageAllocator,
    PageTable,
)
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.plan import PageWrite
from asyncengine.core.builder import DEFAULT_KV_TOKENS, build_core, kv_capacity_pages
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.executor.kv_pool import KVPool


def test_alloc_hands_out_distinct_pages_in_order() -> None:
    allocator = PageAllocator(8)
    first = allocator.alloc(3)
    assert first.dtype == np.int32
    assert first.tolist() == [0, 1, 2]
    assert allocator.alloc(2).tolist() == [3, 4]
    assert allocator.num_free == 3
    assert allocator.num_allocated == 5


def test_alloc_zero_and_negative() -> None:
    allocator = PageAllocator(4)
    assert allocator.alloc(0).size == 0
    with pytest.raises(ValueError):
        allocator.alloc(-1)


def test_out_of_pages_names_the_shortfall_and_changes_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(3)
    with pytest.raises(OutOfPagesError, match="asked for 2 KV pages but only 1 of 4 are free"):
        allocator.alloc(2)
    assert allocator.num_free == 1
    assert allocator.alloc(1).tolist() == [3]


def test_freed_pages_are_reused() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(4)
    allocator.free(pages[[1, 3]])
    assert sorted(allocator.alloc(2).tolist()) == [1, 3]
    assert allocator.num_free == 0


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(2)
    allocator.free(pages[:1])
    with pytest.raises(InvalidFreeError, match="not allocated"):
        allocator.free(pages)  # page 0 again, with the still allocated page 1
    assert allocator.num_free == 3
    assert allocator.is_allocated(int(pages[1]))


def test_free_of_never_allocated_page_raises() -> None:
    allocator = PageAllocator(4)
    with pytest.raises(InvalidFreeError, match="not allocated"):
        allocator.free([2])


def test_free_out_of_range_raises() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(4)
    with pytest.raises(InvalidFreeError, match="out of range"):
        allocator.free([4])
    with pytest.raises(InvalidFreeError, match="out of range"):
        allocator.free([-1])
    assert allocator.num_free == 0


def test_free_of_the_same_page_twice_in_one_call_raises() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(4)
    with pytest.raises(InvalidFreeError, match="more than once"):
        allocator.free([1, 1])
    assert allocator.num_free == 0


def test_free_rejects_non_integer_arrays() -> None:
    allocator = PageAllocator(4)
    allocator.alloc(2)
    with pytest.raises(InvalidFreeError, match="integer"):
        allocator.free(np.array([0.0, 1.0]))


def test_reset_frees_everything() -> None:
    allocator = PageAllocator(3)
    allocator.alloc(3)
    allocator.reset()
    assert allocator.num_free == 3
    assert allocator.alloc(3).tolist() == [0, 1, 2]


@pytest.mark.parametrize("num_pages", [8, 200])  # small frees checked in Python, large in numpy
def test_free_ids_checks_as_free_does_and_changes_nothing_on_error(num_pages: int) -> None:
    allocator = PageAllocator(num_pages)
    pages = allocator.alloc_ids(num_pages // 2)
    assert pages == list(range(num_pages // 2))
    mask = allocator.allocated_mask()
    stack = allocator.free_pages()
    for bad in (
        [*pages[1:], num_pages],  # out of range
        [*pages[1:], -1],
        [*pages[1:], num_pages - 1],  # never allocated
        [*pages, pages[0]],  # listed twice
    ):
        with pytest.raises(InvalidFreeError):
            allocator.free_ids(bad)
        assert allocator.allocated_mask().tolist() == mask.tolist()
        assert allocator.free_pages().tolist() == stack.tolist()
    allocator.free_ids(pages[::-1])
    assert allocator.num_free == num_pages
    assert not allocator.allocated_mask().any()
    assert allocator.alloc_ids(2) == [pages[0], pages[1]]  # LIFO: the last freed comes first


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_matches_a_set_model(ops: list[tuple[bool, int]]) -> None:
    allocator = PageAllocator(10)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > 10 - len(held):
                with pytest.raises(OutOfPagesError):
                    allocator.alloc(n)
            else:
                pages = allocator.alloc(n).tolist()
                assert not set(pages) & set(held)
                held += pages
        else:
            chosen, held = held[:n], held[n:]
            allocator.free(chosen)
        assert allocator.num_free == 10 - len(held)
        assert sorted(allocator.free_pages().tolist() + held) == list(range(10))


def test_page_table_rows_and_pages() -> None:
    table = PageTable(max_rows=3, max_pages_per_row=5)
    assert table.array.dtype == np.int32
    assert table.array.shape == (3, 5)
    row = table.acquire()
    table.set_pages(row, 0, np.array([7, 8], dtype=np.int32))
    table.set_pages(row, 2, [9])
    assert table.array[row, :3].tolist() == [7, 8, 9]
    assert table.row_pages(row, 3).tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="exceed the row width"):
        table.set_pages(row, 4, [1, 2])
    others = [table.acquire(), table.acquire()]
    assert sorted([row, *others]) == [0, 1, 2]
    with pytest.raises(OutOfRowsError):
        table.acquire()
    table.release(others[0])
    assert table.num_free_rows == 1
    with pytest.raises(ValueError, match="not in use"):
        table.release(others[0])
    assert table.acquire() == others[0]


def test_a_rows_only_table_checks_writes_but_keeps_no_pages() -> None:
    """The simulator's table (no executor reads its pages): rows as before, each write checked
    with the same errors, nothing stored or logged."""
    table = PageTable(max_rows=2, max_pages_per_row=4, record_writes=True)
    row = table.acquire()
    table.set_pages(row, 0, [5])
    table.rows_only()
    assert not table.stores_pages and table.drain_writes() == []
    table.set_pages(row, 1, [6, 7])
    table.set_page(row, 3, 8)
    table.set_each([row], [2], [9])
    assert table.drain_writes() == []
    assert table.array[row].tolist() == [5, 0, 0, 0]  # nothing written after rows_only
    with pytest.raises(ValueError, match="exceed the row width"):
        table.set_pages(row, 3, [1, 2])
    with pytest.raises(ValueError, match="exceeds the row width"):
        table.set_page(row, 4, 1)
    with pytest.raises(ValueError, match="exceeds the row width"):
        table.set_each([row], [4], [1])
    with pytest.raises(RuntimeError, match="rows only"):
        table.row_pages(row, 1)
    table.release(row)
    assert table.drain_released() == [row] and table.acquire() == row


def test_kv_pool_shapes_views_and_sizing() -> None:
    pool = KVPool(
        num_layers=2, num_kv_heads=3, head_dim=4, num_pages=5, page_size=2, dtype=torch.float32
    )
    assert pool.k.shape == (2, 10, 3, 4)
    assert pool.v.shape == (2, 10, 3, 4)
    view = pool.k_cache(1)
    assert view.shape == (10, 3, 4)
    view[3] = 1.0
    assert pool.k[1, 3].sum().item() == 12.0  # a view, not a copy
    assert pool.v_cache(0).data_ptr() == pool.v.data_ptr()
    assert pool.bytes_per_token == 2 * 2 * 3 * 4 * 4
    assert pool.nbytes == pool.bytes_per_token * 10
    assert KVPool.num_pages_for_tokens(33, 16) == 3
    assert KVPool.num_pages_for_tokens(32, 16) == 2
    per_page = KVPool.token_bytes(2, 3, 4, torch.bfloat16) * 16
    assert KVPool.num_pages_for_bytes(per_page * 7 + 5, 2, 3, 4, 16, torch.bfloat16) == 7
    with pytest.raises(ValueError):
        KVPool(1, 1, 1, 0, 16)


def test_recorded_writes_rebuild_the_table_elsewhere() -> None:
    """The KV manager's table logs its writes; another table applying them, in order, ends up
    identical (that is how the executor keeps its own table from the plans)."""
    source = PageTable(4, 6, record_writes=True)
    rows = [source.acquire() for _ in range(3)]
    source.set_pages(rows[0], 0, [5, 6, 7])
    source.set_pages(rows[1], 0, [1])
    source.set_pages(rows[0], 1, [9])  # a later write over an earlier one
    writes = source.drain_writes()
    assert writes[0] == PageWrite(rows[0], 0, [5, 6, 7])
    assert source.drain_writes() == []  # drained
    source.set_pages(rows[2], 2, np.array([3, 4], dtype=np.int32))
    writes += source.drain_writes()
    copy = PageTable(4, 6)
    copy.apply(writes)
    assert (copy.array == source.array).all()
    with pytest.raises(RuntimeError, match="does not record"):
        copy.drain_writes()


class LayoutRecorder:
    """An executor that only records the layout it is bound to."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.layout: KVLayout | None = None

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        self.layout = layout

    def execute(self, plan: object) -> object:
        raise AssertionError("not run")


def test_kv_memory_is_sized_from_the_config() -> None:
    dtype = torch.float32
    page_bytes = KVPool.token_bytes(2, 2, 8, dtype) * 4
    spec = ModelSpec(4096, 64, (0,), KVPool.token_bytes(2, 2, 8, dtype))

    # A byte budget: the most whole pages that fit, and the context is capped by the pool.
    budget = page_bytes * 11 - 1
    config = EngineConfig(page_size=4, kv_cache_bytes=budget, max_running_requests=3)
    executor = LayoutRecorder(spec)
    core = build_core(config, executor)
    assert executor.layout == KVLayout(num_pages=10, page_size=4, max_rows=3, max_pages_per_row=10)
    pool = KVPool(2, 2, 8, executor.layout.num_pages, 4, dtype)
    assert pool.nbytes <= budget < pool.nbytes + page_bytes
    assert core.kv.num_pages == core.kv.allocator.num_free == 10
    assert core.max_model_len == 40 and core.kv.max_tokens_per_request == 40
    assert core.kv.page_table.max_rows == 3

    # A token capacity rounds up to whole pages.
    config = EngineConfig(page_size=4, kv_cache_tokens=50, max_model_len=16)
    executor = LayoutRecorder(spec)
    core = build_core(config, executor)
    assert executor.layout is not None and executor.layout.num_slots == 52
    assert core.kv.num_pages == 13
    assert core.max_model_len == 16 and core.kv.max_pages_per_row == 4

    default = EngineConfig()
    assert default.page_size == 16
    assert kv_capacity_pages(default, spec, None) == DEFAULT_KV_TOKENS // 16
    too_small = EngineConfig(page_size=4, kv_cache_bytes=page_bytes - 1)
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        kv_capacity_pages(too_small, spec, None)


def test_gpu_pool_takes_the_memory_left_by_weights_and_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA with no size given, the pool fills gpu_memory_utilization of the GPU's memory
    less what is in use, the weights and the activation reserve (mem_get_info faked here)."""
    from asyncengine.executor import model_executor

    gib = 2**30
    free, total = 70 * gib, 80 * gib  # 10 GiB in use already
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    cached = 0  # held by torch's allocator, unused
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib + cached)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * gib)
    dtype, cuda = torch.bfloat16, torch.device("cuda")
    spec = ModelSpec(4096, 64, (0,), KVPool.token_bytes(2, 2, 8, dtype))
    page_bytes = spec.kv_bytes_per_token * 16
    weights = 3 * gib

    config = EngineConfig(gpu_memory_utilization=0.5)
    budget = model_executor.gpu_kv_budget_bytes(0.5, cuda, weights)
    assert budget == 40 * gib - 10 * gib - weights - model_executor.GPU_ACTIVATION_RESERVE
    assert kv_capacity_pages(config, spec, budget) == budget // page_bytes
    # An explicit size wins; CPU (no budget offered) keeps the fixed default.
    sized = EngineConfig(kv_cache_tokens=4096)
    assert kv_capacity_pages(sized, spec, budget) == 256
    assert kv_capacity_pages(config, spec, None) == DEFAULT_KV_TOKENS // 16

    with pytest.raises(ConfigError, match="gpu_memory_utilization.*no room for the KV pool"):
        model_executor.gpu_kv_budget_bytes(0.15, cuda, weights)  # 12 GiB: < in use + reserve
    # A stopped engine's pool left in torch's cache (a second engine in the process) is free.
    free, cached = 30 * gib, 40 * gib
    assert model_executor.gpu_kv_budget_bytes(0.5, cuda, weights) == budget
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
