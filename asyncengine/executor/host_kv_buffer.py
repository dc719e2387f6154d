"""HostKVBuffer: the host-side tensor area that preempted requests' KV pages are swapped into.

Same layout as the pool (``[layers, pages * page_size, kv_heads, row_width]`` for K and for V),
in CPU memory (pinned when the pool is on a GPU, so copies run at full PCIe bandwidth). The
scheduler's ``SwapSpace`` (cache/swap_space.py) decides which host page holds what; this class
only runs a plan's copies: its ``swap_out`` (pool -> host) first, then its ``swap_in``
(host -> pool), before the page writes and the forward.

On a CPU a plan's page pairs are cut into runs (consecutive source pages to consecutive
destination pages: a request's pages mostly are), copied in one pass by a native loop of
memcpy per run and layer (kernels/cpu/cpu_page_copy.c); indexing with page lists instead
gathers into a temporary and scatters it again, several times slower
(scripts/micro/bench_host_copy.py measures both).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from asyncengine.common.plan import SwapCopy
from asyncengine.executor.kv_pool import KVPool
from asyncengine.kernels.cpu.page_copy_native import copy_page_runs


class HostKVBuffer:
    def __init__(self, pool: KVPool, num_pages: int) -> None:
        self.pool = pool
        self.num_pages = num_pages
        self.page_size = pool.page_size
        shape = (pool.num_layers, num_pages * pool.page_size, pool.num_kv_heads, pool.row_width)
        pin = pool.device.type == "cuda"
        # left unwritten, like the CPU pool: the OS maps pages in as swaps first touch them
        self.k = torch.empty(shape, dtype=pool.dtype, pin_memory=pin)
        self.v = torch.empty(shape, dtype=pool.dtype, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _pages(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` viewed as ``[layers, pages, page_size, kv_heads, head_dim]``."""
        layers, slots, heads, dim = tensor.shape
        return tensor.view(layers, slots // self.page_size, self.page_size, heads, dim)

    def run(self, swap_out: list[SwapCopy], swap_in: list[SwapCopy]) -> float:
        """Run a plan's copies (out first, then in); returns the seconds they took."""
        if not swap_out and not swap_in:
            return 0.0
        start = time.perf_counter()
        device = self.pool.device
        pool_k, pool_v = self._pages(self.pool.k), self._pages(self.pool.v)
        host_k, host_v = self._pages(self.k), self._pages(self.v)
        if device.type == "cpu":
            # out first: a pool page the plan frees and reuses is read before it is written
            out = page_runs([c.pool_pages for c in swap_out], [c.host_pages for c in swap_out])
            copy_page_runs(host_k, pool_k, out)
            copy_page_runs(host_v, pool_v, out)
            into = page_runs([c.host_pages for c in swap_in], [c.pool_pages for c in swap_in])
            copy_page_runs(pool_k, host_k, into)
            copy_page_runs(pool_v, host_v, into)
            return time.perf_counter() - start
        for copy in swap_out:
            src = torch.tensor(copy.pool_pages, dtype=torch.long, device=device)
            dst = torch.tensor(copy.host_pages, dtype=torch.long)
            host_k[:, dst] = pool_k[:, src].to("cpu")
            host_v[:, dst] = pool_v[:, src].to("cpu")
        for copy in swap_in:
            src = torch.tensor(copy.host_pages, dtype=torch.long)
            dst = torch.tensor(copy.pool_pages, dtype=torch.long, device=device)
            pool_k[:, dst] = host_k[:, src].to(device, non_blocking=True)
            pool_v[:, dst] = host_v[:, src].to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start


def page_runs(sources: list[list[int]], dests: list[list[int]]) -> list[tuple[int, int, int]]:
    """The page pairs ``sources[i][j] -> dests[i][j]`` as ``(first source, first destination,
    count)`` runs of consecutive pages on both sides, in source order (each destination is
    written once, so the order of the runs does not matter)."""
    src = np.fromiter((p for pages in sources for p in pages), dtype=np.int64)
    dst = np.fromiter((p for pages in dests for p in pages), dtype=np.int64)
    assert src.shape == dst.shape, "every copied page needs a destination"
    if src.size == 0:
        return []
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), counts.tolist(), strict=True))
