"""HostKVBuffer: the host-side tensor area that preempted requests' KV pages are swapped into.

Same layout as the pool (``[layers, pages * page_size, kv_heads, row_width]`` for K and for V),
in CPU memory (pinned when the pool is on a GPU, so copies run at full PCIe bandwidth). The
scheduler's ``SwapSpace`` (cache/swap_space.py) decides which host page holds what; this class
only runs a plan's copies: its ``swap_out`` (pool -> host) first, then its ``swap_in``
(host -> pool), before the page writes and the forward.
"""

from __future__ import annotations

import time

import torch

from asyncengine.common.plan import SwapCopy
from asyncengine.executor.kv_pool import KVPool


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
