"""A decode step's LoRA rows as the fused step takes them (kernels/cpu/decode_step_lora.py):
each adapter's table (executor/lora/native_tables.py), then per step an adapter index per row
(-1: the base)."""

from __future__ import annotations

import numpy as np

from asyncengine.executor.lora.lora_step import LoraStep
from asyncengine.executor.lora.native_tables import TableCache
from asyncengine.kernels.cpu.decode_step_lora import AdapterTable, StepLora
from asyncengine.kernels.cpu.decode_step_native import DecodeShape
from asyncengine.kernels.cpu.lora_native import PreparedLora


class NativeDecodeLora:
    """The adapter tables of one fused-step model (``LlamaModel.native_decode``)."""

    def __init__(self, shape: DecodeShape, num_layers: int) -> None:
        q_size = shape.num_heads * shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        h, inter = shape.hidden, shape.intermediate
        # (in, out) of each target: an update of other shapes is not the step's to add
        self.shapes = ((h, qkv), (q_size, h), (h, 2 * inter), (inter, h))
        self.num_layers = num_layers
        self.tables = TableCache(self._fits)

    def _fits(self, prepared: PreparedLora, target: int) -> bool:
        return prepared.args[3:5] == self.shapes[target]

    def step_rows(self, lora: LoraStep, num_rows: int) -> StepLora | None:
        """The step's rows by adapter, or None where some adapter cannot run in the fused step
        (then the layer-by-layer path adds its updates)."""
        tables: list[AdapterTable] = []
        row_adapter = np.full(num_rows, -1, dtype=np.int32)
        for group in lora.groups:
            if len(group.adapter.layers) != self.num_layers:
                return None
            table = self.tables.table(group.adapter)
            if table is None:
                return None
            for start, end in group.segments.tolist():
                row_adapter[start:end] = len(tables)
            tables.append(table)
        if len({t.dtype for t in tables}) > 1:
            return None
        return StepLora(tables, row_adapter)
