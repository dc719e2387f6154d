"""Test pools that catch a read of a wrong slot: NaN-filled, pages handed out shuffled."""

from __future__ import annotations

import numpy as np
import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig


def shuffled_page_table(
    num_rows: int, max_len: int, page_size: int, seed: int, spare_pages: int = 0
) -> tuple[PageTable, int]:
    """A table whose rows own interleaved pages of a pool (plus spare pages); (table, pages)."""
    pages_per_row = -(-max_len // page_size)
    num_pages = pages_per_row * num_rows + spare_pages
    table = PageTable(num_rows, pages_per_row)
    order = np.random.default_rng(seed).permutation(num_pages)
    for row in range(num_rows):
        table.set_pages(row, 0, order[row * pages_per_row : (row + 1) * pages_per_row])
    return table, num_pages


def nan_pool(config: ModelConfig, num_pages: int, page_size: int) -> KVPool:
    """A float32 pool whose every slot is NaN until written: reading an unwritten slot shows."""
    pool = KVPool(
        config.num_layers, config.num_kv_heads, config.head_dim, num_pages, page_size, torch.float32
    )
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    return pool
