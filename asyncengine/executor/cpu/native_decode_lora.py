"""A decode step's LoRA rows as the fused step takes them (kernels/cpu/decode_step_lora.py):
each adapter's table built once and kept while the adapter object lives in the cache, then per
step an adapter index per row (-1: the base)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from asyncengine.executor.lora.lora_step import LoraStep
from asyncengine.executor.lora.peft_adapter import LoraAdapter
from asyncengine.kernels.cpu.decode_step_lora import AdapterTable, StepLora
from asyncengine.kernels.cpu.decode_step_native import DecodeShape
from asyncengine.kernels.cpu.lora_native import PreparedLora

# the projections the step adds updates after, in its table's order (TARGETS)
TARGET_NAMES = ("qkv", "o_proj", "gate_up", "down")
# adapter tables kept (least recently used dropped): a few hundred bytes a layer each
MAX_TABLES = 64


class NativeDecodeLora:
    """The adapter tables of one fused-step model (``LlamaModel.native_decode``)."""

    def __init__(self, shape: DecodeShape, num_layers: int) -> None:
        q_size = shape.num_heads * shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        h, inter = shape.hidden, shape.intermediate
        # (in, out) of each target: an update of other shapes is not the step's to add
        self.shapes = ((h, qkv), (q_size, h), (h, 2 * inter), (inter, h))
        self.num_layers = num_layers
        # id -> (adapter, its table or None where the step cannot take it); the adapter is
        # held, so that its id names it while the entry lives
        self._tables: OrderedDict[int, tuple[LoraAdapter, AdapterTable | None]] = OrderedDict()

    def table(self, adapter: LoraAdapter) -> AdapterTable | None:
        entry = self._tables.get(id(adapter))
        if entry is not None and entry[0] is adapter:
            self._tables.move_to_end(id(adapter))
            return entry[1]
        table = self._build(adapter)
        self._tables[id(adapter)] = (adapter, table)
        while len(self._tables) > MAX_TABLES:
            self._tables.popitem(last=False)
        return table

    def _build(self, adapter: LoraAdapter) -> AdapterTable | None:
        if len(adapter.layers) != self.num_layers:
            return None
        layers: list[list[PreparedLora | None]] = []
        for updates in adapter.layers:
            row: list[PreparedLora | None] = []
            for name, (in_features, out_features) in zip(TARGET_NAMES, self.shapes, strict=True):
                update = updates.get(name)
                if update is None:
                    row.append(None)
                    continue
                prepared = update.native
                if prepared is None or prepared.args[3:5] != (in_features, out_features):
                    return None
                row.append(prepared)
            layers.append(row)
        return AdapterTable(layers)

    def step_rows(self, lora: LoraStep, num_rows: int) -> StepLora | None:
        """The step's rows by adapter, or None where some adapter cannot run in the fused step
        (then the layer-by-layer path adds its updates)."""
        tables: list[AdapterTable] = []
        row_adapter = np.full(num_rows, -1, dtype=np.int32)
        for group in lora.groups:
            table = self.table(group.adapter)
            if table is None:
                return None
            for start, end in group.segments.tolist():
                row_adapter[start:end] = len(tables)
            tables.append(table)
        if len({t.dtype for t in tables}) > 1:
            return None
        return StepLora(tables, row_adapter)
