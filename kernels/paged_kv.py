"""Indexing the paged KV pool from torch: key slots of requests, gathers, subsets of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_kv_slots(
    block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int, page_size: int
) -> torch.Tensor:
    """[B, max_len] int64 pool slots of keys 0..seq_len-1, padded with the last key's slot.

    Padding keys repeat the request's last real key, so every key read is finite (a slot never
    written may hold anything, and 0 * NaN is NaN even where a mask zeroes the probability).
    """
    positions = torch.arange(max_len, device=seq_lens.device).unsqueeze(0)
    positions = torch.minimum(positions, (seq_lens.long() - 1).unsqueeze(1))
    pages = block_table.long().gather(1, positions // page_size)
    return pages * page_size + positions % page_size


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [*kv_slots.shape, Hkv * D] of the slots: one ``index_select`` of whole token rows
    (the fastest gather on CPU); ``out`` holds at least that many rows."""
    num_slots = k_cache.shape[0]
    flat = kv_slots.reshape(-1)
    k_rows, v_rows = k_cache.view(num_slots, -1), v_cache.view(num_slots, -1)
    shape = (*kv_slots.shape, k_rows.shape[1])
    if out is None:
        return k_rows.index_select(0, flat).view(shape), v_rows.index_select(0, flat).view(shape)
    k_out = out[0].view(-1, shape[-1])[: flat.shape[0]]
    v_out = out[1].view(-1, shape[-1])[: flat.shape[0]]
    torch.index_select(k_rows, 0, flat, out=k_out)
    torch.index_select(v_rows, 0, flat, out=v_out)
    return k_out.view(shape), v_out.view(shape)


def gather_buffers(cache: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reusable K and V gather buffers of ``rows`` token rows [rows, Hkv * D]."""
    shape = (rows, cache[0].numel())
    return (
        torch.empty(shape, dtype=cache.dtype, device=cache.device),
        torch.empty(shape, dtype=cache.dtype, device=cache.device),
    )


@dataclass(slots=True)
class RowSelection:
    """Some rows of a tensor (requests of a batch, tokens of a forward): rows ``start .. start
    + count`` when consecutive (taken as a view, no copy), else the rows ``index`` [count]."""

    start: int
    count: int
    index: torch.Tensor | None

    @staticmethod
    def of(rows: list[int], device: torch.device) -> RowSelection:
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return RowSelection(rows[0], len(rows), None)
        return RowSelection(0, len(rows), torch.tensor(rows, dtype=torch.int64, device=device))

    @property
    def positions(self) -> torch.Tensor | slice:
        """For indexing a batch-sized tensor (block table, lengths) on its first dimension."""
        if self.index is None:
            return slice(self.start, self.start + self.count)
        return self.index

    def take(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x[self.start : self.start + self.count]
        return x.index_select(0, self.index)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.index is None:
            out[self.start : self.start + self.count] = values
        else:
            out.index_copy_(0, self.index, values)
