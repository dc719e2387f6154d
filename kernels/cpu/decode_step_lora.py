"""LoRA in the fused decode step (kernels/cpu/cpu_step_lora.h): each adapter's projections as
the step reads them (``AdapterTable``, built once per adapter), and one step's rows by adapter
(``StepLora``, built per step: an index per row, -1 for the base)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PreparedLora:
    """One projection's adapter weights with the kernel's constant arguments worked out once
    (a decode step makes ~120 calls: their Python share is most of the cost at batch 1)."""

    a: torch.Tensor
    bt: torch.Tensor
    slices: np.ndarray
    args: tuple[int, int, int, int, int, int]  # a, bt, weights bf16, in, out, rank
    dtype: torch.dtype


TARGETS = 4  # qkv, o_proj, gate_up, down: LORA_TARGETS in the C header, in that order
TILE = 16  # outputs of one tile of B: LORA_TILE in the C header
ALIGN = 64  # each matrix of a table starts on a cache line
_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class _LoraProj(ctypes.Structure):
    _fields_ = [
        ("a", _PTR),
        ("b_tiles", _PTR),
        ("slices", _PTR),
        ("n_slices", _I64),
        ("in_features", _I64),
        ("out_features", _I64),
        ("rank", _I64),
    ]


class LoraDesc(ctypes.Structure):
    _fields_ = [
        ("adapters", _PTR),
        ("row_adapter", _PTR),
        ("order", _PTR),
        ("n_order", _I64),
        ("max_rank", _I64),
        ("w_bf16", _I32),
    ]


def b_tiles(bt: torch.Tensor, slices: np.ndarray) -> torch.Tensor:
    """B as the step reads it (cpu_step_lora.h): per slice (out_start, out_end, rank_start,
    rank_end), ceil(width / TILE) tiles of [slice rank, TILE], zero past out_end; flat."""
    parts = []
    for o0, o1, r0, r1 in slices.tolist():
        width = o1 - o0
        tiles = -(-width // TILE)
        block = torch.nn.functional.pad(bt[r0:r1, o0:o1], (0, tiles * TILE - width))
        parts.append(block.reshape(r1 - r0, tiles, TILE).transpose(0, 1).reshape(-1))
    return torch.cat(parts) if parts else bt.new_zeros(0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class AdapterTable:
    """One adapter's updates, [layer][target] (None: that projection untouched), as C structs
    over one buffer holding every A and B in the order a step reads them (``buffer``: how it is
    allocated, uint8 of a size; the executor gives huge pages, as for the base weights)."""

    def __init__(
        self,
        layers: Sequence[Sequence[PreparedLora | None]],
        buffer: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        prepared_all = [p for layer in layers for p in layer if p is not None]
        dtypes = {p.dtype for p in prepared_all}
        if len(dtypes) > 1:
            raise ValueError("an adapter's projections must share one dtype")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        if any(len(layer) != TARGETS for layer in layers):
            raise ValueError(f"a layer has {TARGETS} LoRA targets")
        # the table holds the slices arrays by address (slot.slices): keep them alive with it
        self._slices = [p.slices for p in prepared_all]
        packed = [(p.a, b_tiles(p.bt, p.slices)) for p in prepared_all]
        total = sum(_round_up(m.nbytes, ALIGN) for pair in packed for m in pair)
        self.buffer = (buffer or _plain_buffer)(max(total, 1))
        addresses: list[int] = []
        start = 0
        for pair in packed:
            for matrix in pair:
                flat = matrix.contiguous().reshape(-1).view(torch.uint8)
                self.buffer[start : start + flat.numel()].copy_(flat)
                addresses.append(self.buffer.data_ptr() + start)
                start += _round_up(flat.numel(), ALIGN)
        self.projs = (_LoraProj * (len(layers) * TARGETS))()
        self.max_rank = 0
        index = 0
        for layer_index, layer in enumerate(layers):
            for t, prepared in enumerate(layer):
                if prepared is None:
                    continue
                _, _, _, in_features, out_features, rank = prepared.args
                slot = self.projs[layer_index * TARGETS + t]
                slot.a, slot.b_tiles = addresses[2 * index], addresses[2 * index + 1]
                index += 1
                slot.slices = prepared.slices.ctypes.data
                slot.n_slices = int(prepared.slices.shape[0])
                slot.in_features, slot.out_features, slot.rank = in_features, out_features, rank
                self.max_rank = max(self.max_rank, rank)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.projs)


def _data(array: np.ndarray) -> int:
    """array's data address (``array.ctypes.data`` builds a ctypes view first, ~2 us)."""
    return int(array.__array_interface__["data"][0])


def _plain_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class StepLora:
    """One step's adapter rows: ``row_adapter[i]`` indexes ``tables`` (-1: the base alone)."""

    def __init__(self, tables: Sequence[AdapterTable], row_adapter: np.ndarray) -> None:
        if len({t.dtype for t in tables}) > 1:
            raise ValueError("the adapters of one step must share one dtype")
        if row_adapter.dtype != np.int32 or row_adapter.ndim != 1:
            raise ValueError("row_adapter must be a 1-d int32 array")
        # a decode step builds one per step: plain Python over the rows (a few), no numpy
        # reductions or ctypes views, ~4x cheaper than them at one row
        values = row_adapter.tolist()
        if values and not -1 <= min(values) <= max(values) < len(tables):
            raise ValueError("row_adapter indexes past the step's adapters")
        self.tables = tuple(tables)
        self.rows = np.ascontiguousarray(row_adapter)
        # the adapter rows grouped by adapter (stable): the kernels run a group's rows together
        by_adapter = sorted(range(len(values)), key=values.__getitem__)
        self.order = np.array([i for i in by_adapter if values[i] >= 0], dtype=np.int32)
        self._pointers = (_PTR * max(len(tables), 1))(*(t.address for t in tables))
        self.desc = LoraDesc(
            adapters=ctypes.addressof(self._pointers),
            row_adapter=_data(self.rows),
            order=_data(self.order),
            n_order=len(self.order),
            max_rank=max((t.max_rank for t in tables), default=0),
            w_bf16=int(bool(tables) and tables[0].dtype == torch.bfloat16),
        )

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])
