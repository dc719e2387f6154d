"""Each adapter's updates as the native kernels' table (kernels/cpu/decode_step_lora.py's
``AdapterTable``: per layer, qkv / o_proj / gate_up / down), built once per adapter and kept in
a small cache that holds the adapter, so that its id names it while the entry lives."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from asyncengine.executor.lora.peft_adapter import LoraAdapter
from asyncengine.kernels.cpu.decode_step_lora import AdapterTable
from asyncengine.kernels.cpu.lora_native import PreparedLora

# the projections in the table's order (TARGETS)
TARGET_NAMES = ("qkv", "o_proj", "gate_up", "down")
# tables kept (least recently used dropped): a few hundred bytes a layer each
MAX_TABLES = 64


def target_slot(layer: int, projection: str) -> int:
    return layer * len(TARGET_NAMES) + TARGET_NAMES.index(projection)


class TableCache:
    """Adapter -> its table, or None where some update is not the native kernel's to take
    (not prepared for it, or refused by ``accepts``: the update, its target's index)."""

    def __init__(self, accepts: Callable[[PreparedLora, int], bool] | None = None) -> None:
        self.accepts = accepts
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
        layers: list[list[PreparedLora | None]] = []
        for updates in adapter.layers:
            row: list[PreparedLora | None] = []
            for target, name in enumerate(TARGET_NAMES):
                update = updates.get(name)
                if update is None:
                    row.append(None)
                    continue
                prepared = update.native
                if prepared is None or (self.accepts and not self.accepts(prepared, target)):
                    return None
                row.append(prepared)
            layers.append(row)
        return AdapterTable(layers)
