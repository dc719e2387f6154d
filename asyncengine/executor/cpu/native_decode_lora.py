"""A decode step's LoRA rows as the fused step takes them (kernels/cpu/decode_step_lora.py): the
step's table that ``lora_step`` built (an adapter index per row, -1: the base), where every
adapter's updates have the shapes of this model's projections."""

from __future__ import annotations

from asyncengine.executor.lora.lora_step import LoraStep
from asyncengine.executor.lora.native_tables import TARGET_NAMES
from asyncengine.executor.lora.peft_adapter import LoraAdapter
from asyncengine.kernels.cpu.decode_step_lora import StepLora
from asyncengine.kernels.cpu.decode_step_native import DecodeShape


class NativeDecodeLora:
    """Which adapters' tables a fused-step model (``LlamaModel.native_decode``) takes."""

    def __init__(self, shape: DecodeShape, num_layers: int) -> None:
        q_size = shape.num_heads * shape.head_dim
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        h, inter = shape.hidden, shape.intermediate
        # (in, out) of each target: an update of other shapes is not the step's to add
        sizes = ((h, qkv), (q_size, h), (h, 2 * inter), (inter, h))
        self.shapes = dict(zip(TARGET_NAMES, sizes, strict=True))
        self.num_layers = num_layers

    def _fits(self, adapter: LoraAdapter) -> bool:
        """Checked once per adapter (kept on it, as its tables)."""
        known = adapter.tables.get(self)
        if isinstance(known, bool):
            return known
        fits = len(adapter.layers) == self.num_layers and all(
            update.native is not None and update.native.args[3:5] == self.shapes[name]
            for updates in adapter.layers
            for name, update in updates.items()
        )
        adapter.tables[self] = fits
        return fits

    def step_rows(self, lora: LoraStep, num_rows: int) -> StepLora | None:
        """The step's rows by adapter, or None where some adapter cannot run in the fused step
        (then the layer-by-layer path adds its updates)."""
        table = lora.table
        if (
            table is None
            or table.num_rows != num_rows
            or not all(group.in_table and self._fits(group.adapter) for group in lora.groups)
        ):
            return None
        return table
