"""The LoRA updates of one forward: which flat token rows run under which adapter, and the
hook the model calls after each projection (``LlamaModel.forward``) to add them.

Tokens lie in the ForwardBatch's order: extend segments, then decodes, each segment's tokens
together (a verify step's rows too), so a segment's adapter covers ``len(input_ids)`` rows.
Rows of no adapter get nothing added: one step mixes adapters and the base.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncengine.common.plan import BatchPlan
from asyncengine.executor.lora.native_tables import TableCache, target_slot
from asyncengine.executor.lora.peft_adapter import LoraAdapter
from asyncengine.executor.lora.registry import LoraRegistry
from asyncengine.kernels.cpu import lora_native
from asyncengine.kernels.cpu.decode_step_lora import AdapterTable, StepLora
from asyncengine.kernels.reference.lora_ref import lora_apply_ref

# the adapters' native tables: a CPU step's rows of every adapter take one call per projection
# (a prefill's rows too: the native kernel runs four rows of an adapter per pass over its
# weights, ~1.5-2x faster than the torch products per adapter at 1,024 rows of 8 adapters, in
# float32 and bfloat16)
TABLES = TableCache()


@dataclass(slots=True)
class AdapterRows:
    adapter: LoraAdapter
    rows: torch.Tensor  # [k] int64 flat token rows, ascending
    segments: np.ndarray  # [s, 2] int64 (start, end) runs of those rows
    in_table: bool = False  # its rows are the step's table's (LoraStep.table)


class LoraStep:
    """Built once per forward that has LoRA rows; ``apply`` is the per-projection hook."""

    def __init__(
        self, groups: list[AdapterRows], device: torch.device, table: StepLora | None = None
    ) -> None:
        self.groups = groups
        self.device = device
        # the groups marked in_table in one native call per projection (a CPU's rows)
        self.table = table

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every adapter's update of ``projection`` in ``layer`` to its rows of ``y``."""
        tabled = self.table is not None and lora_native.apply_table(
            y, x, self.table, target_slot(layer, projection), int(x.shape[1])
        )
        for group in self.groups:
            if tabled and group.in_table:
                continue
            update = group.adapter.layers[layer].get(projection)
            if update is None:
                continue
            if self.device.type == "cuda":
                from asyncengine.kernels.triton.triton_lora import lora_apply

                lora_apply(y, x, group.rows, update.a, update.b)
            elif self.device.type != "cpu":
                lora_apply_ref(y, x, group.rows, update.a, update.b)
            elif update.native is None or not lora_native.apply_prepared(
                y, x, group.segments, update.native
            ):
                slices = lora_native.slices_array(update.slices)
                lora_native.lora_apply(
                    y, x, group.segments, group.rows, update.a, update.bt, slices
                )


def plan_adapters(plan: BatchPlan) -> set[str]:
    return {s.lora for s in plan.segments if s.lora is not None}


def lora_step(plan: BatchPlan, registry: LoraRegistry, device: torch.device) -> LoraStep | None:
    """The plan's LoRA rows by adapter, or None when every segment runs on the base."""
    names = plan_adapters(plan)
    if not names:
        return None
    adapters = registry.adapters(names)
    runs: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    at = 0
    for seg in plan.segments:
        n = len(seg.input_ids)
        if seg.lora is not None:
            spans = runs[seg.lora]
            if spans and spans[-1][1] == at:
                spans[-1] = (spans[-1][0], at + n)
            else:
                spans.append((at, at + n))
        at += n
    groups: list[AdapterRows] = []
    for name in sorted(names):
        segments = np.array(runs[name], dtype=np.int64).reshape(-1, 2)
        rows = np.concatenate([np.arange(s, e) for s, e in runs[name]])
        groups.append(AdapterRows(adapters[name], torch.from_numpy(rows).to(device), segments))
    table = _groups_table(groups, at) if device.type == "cpu" else None
    return LoraStep(groups, device, table)


def _groups_table(groups: list[AdapterRows], num_rows: int) -> StepLora | None:
    """The groups as one table (marked ``in_table``), or None where the native kernel is not
    here or some adapter is not its to take."""
    if not lora_native.available():
        return None
    tables: list[AdapterTable] = []
    for group in groups:
        table = TABLES.table(group.adapter)
        if table is None:
            return None
        tables.append(table)
    if not tables or len({t.dtype for t in tables}) > 1:
        return None
    row_adapter = np.full(num_rows, -1, dtype=np.int32)
    for index, group in enumerate(groups):
        for start, end in group.segments.tolist():
            row_adapter[start:end] = index
        group.in_table = True
    return StepLora(tables, row_adapter)
