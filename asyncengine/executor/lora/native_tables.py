"""Each adapter's updates as the native kernels' table (kernels/cpu/decode_step_lora.py's
``AdapterTable``: per layer, qkv / o_proj / gate_up / down, in one huge-page buffer in the order a
step reads them, as the base weights: weights scattered over 4 KiB pages stall a batch-1 step on
TLB misses and stop the hardware prefetcher at every page), built once per adapter and kept on the
adapter (``LoraAdapter.tables``), so that it goes when the registry drops the adapter."""

from __future__ import annotations

from asyncengine.executor.cpu.weight_arena import hugepage_buffer
from asyncengine.executor.lora.peft_adapter import LoraAdapter
from asyncengine.kernels.cpu.decode_step_lora import AdapterTable, PreparedLora

# the projections in the table's order (TARGETS)
TARGET_NAMES = ("qkv", "o_proj", "gate_up", "down")


def target_slot(layer: int, projection: str) -> int:
    return layer * len(TARGET_NAMES) + TARGET_NAMES.index(projection)


class TableCache:
    """Adapter -> its table, or None where some update is not the native kernel's to take (not
    prepared for it)."""

    def table(self, adapter: LoraAdapter) -> AdapterTable | None:
        if self in adapter.tables:
            table = adapter.tables[self]
            return table if isinstance(table, AdapterTable) else None
        built = self._build(adapter)
        adapter.tables[self] = built
        return built

    def _build(self, adapter: LoraAdapter) -> AdapterTable | None:
        layers: list[list[PreparedLora | None]] = []
        for updates in adapter.layers:
            row: list[PreparedLora | None] = []
            for name in TARGET_NAMES:
                update = updates.get(name)
                if update is None:
                    row.append(None)
                    continue
                prepared = update.native
                if prepared is None:
                    return None
                row.append(prepared)
            layers.append(row)
        return AdapterTable(layers, hugepage_buffer)
