"""PageAllocator, PageTable and KVPool."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.cache import (
    InvalidFreeError,
    KVPool,
    OutOfPagesError,
    OutOfRowsError,
    PageAllocator,
    PageTable,
)
from asyncengine.config import ConfigError, EngineConfig
from asyncengine.worker import DEFAULT_KV_TOKENS, build_kv_memory, kv_capacity_pages


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
    table = PageTable(max_requests=3, max_pages_per_request=5)
    assert table.table.dtype == torch.int32
    assert table.table.shape == (3, 5)
    row = table.acquire()
    table.set_pages(row, 0, np.array([7, 8], dtype=np.int32))
    table.set_pages(row, 2, [9])
    assert table.table[row, :3].tolist() == [7, 8, 9]  # writes reach the tensor
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


def test_kv_memory_is_sized_from_the_config() -> None:
    # Only the fields build_kv_memory reads; a real ModelConfig needs a checkpoint.
    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, max_model_len=4096)
    cpu, dtype = torch.device("cpu"), torch.float32
    page_bytes = KVPool.token_bytes(2, 2, 8, dtype) * 4

    # A byte budget: the most whole pages that fit, and the context is capped by the pool.
    budget = page_bytes * 11 - 1
    config = EngineConfig(page_size=4, kv_cache_bytes=budget, max_running_requests=3)
    pool, kv, max_model_len = build_kv_memory(config, model, dtype, cpu)  # type: ignore[arg-type]
    assert pool.num_pages == kv.num_pages == kv.allocator.num_free == 10
    assert pool.nbytes <= budget < pool.nbytes + page_bytes
    assert pool.k.dtype == pool.v.dtype == dtype and pool.page_size == kv.page_size == 4
    assert pool.k.shape == (2, 40, 2, 8)
    assert max_model_len == 40 and kv.max_tokens_per_request == 40
    assert kv.page_table.max_requests == 3

    # A token capacity rounds up to whole pages.
    config = EngineConfig(page_size=4, kv_cache_tokens=50, max_model_len=16)
    pool, kv, max_model_len = build_kv_memory(config, model, dtype, cpu)  # type: ignore[arg-type]
    assert pool.num_pages == kv.num_pages == 13 and pool.num_slots == 52
    assert max_model_len == 16 and kv.max_pages_per_request == 4

    default = EngineConfig()
    assert default.page_size == 16
    assert kv_capacity_pages(default, model, dtype) == DEFAULT_KV_TOKENS // 16  # type: ignore[arg-type]
    too_small = EngineConfig(page_size=4, kv_cache_bytes=page_bytes - 1)
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        kv_capacity_pages(too_small, model, dtype)  # type: ignore[arg-type]


def test_gpu_pool_takes_the_memory_left_by_weights_and_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA with no size given, the pool fills gpu_memory_utilization of the GPU's memory
    less what is in use, the weights and the activation reserve (mem_get_info faked here)."""
    from asyncengine import worker

    gib = 2**30
    free, total = 70 * gib, 80 * gib  # 10 GiB in use already
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, max_model_len=4096)
    dtype, cuda = torch.bfloat16, torch.device("cuda")
    page_bytes = KVPool.token_bytes(2, 2, 8, dtype) * 16
    weights = 3 * gib

    config = EngineConfig(gpu_memory_utilization=0.5)
    budget = 40 * gib - 10 * gib - weights - worker.GPU_ACTIVATION_RESERVE
    pages = kv_capacity_pages(config, model, dtype, cuda, weights)  # type: ignore[arg-type]
    assert pages == budget // page_bytes
    # An explicit size wins; CPU keeps the fixed default.
    sized = EngineConfig(kv_cache_tokens=4096)
    assert kv_capacity_pages(sized, model, dtype, cuda, weights) == 256  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    assert kv_capacity_pages(config, model, dtype, cpu) == DEFAULT_KV_TOKENS // 16  # type: ignore[arg-type]

    crowded = EngineConfig(gpu_memory_utilization=0.15)  # 12 GiB: less than in use + reserve
    with pytest.raises(ConfigError, match="gpu_memory_utilization.*no room for the KV pool"):
        kv_capacity_pages(crowded, model, dtype, cuda, weights)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
