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

# From this many rows of one adapter the two products run as GEMMs (oneDNN) instead of the
# native kernel's row-by-row dot products (a prefill chunk's rows); not measured on a quiet
# machine: scripts/bench_lora.py is the command that would tune it.
GEMM_FROM_ROWS = 16
# the adapters' native tables, for the steps whose rows of few per adapter take one call per
# projection for all adapters
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
        # the groups marked in_table in one native call per projection (a CPU's decode rows)
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
            elif self.device.type != "cpu" or group.rows.shape[0] >= GEMM_FROM_ROWS:
                lora_apply_ref(y, x, group.rows, update.a, update.b)  # a prefill's rows: GEMMs
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
    table = _small_groups_table(groups, at) if device.type == "cpu" else None
    return LoraStep(groups, device, table)


def _small_groups_table(groups: list[AdapterRows], num_rows: int) -> StepLora | None:
    """The groups of fewer than GEMM_FROM_ROWS rows as one table (marked ``in_table``), or None
    where there are none or the native kernel is not here."""
    if not lora_native.available():
        return None
    small = [g for g in groups if g.rows.shape[0] < GEMM_FROM_ROWS]
    tables: list[AdapterTable] = []
    for group in small:
        table = TABLES.table(group.adapter)
        if table is None:
            return None
        tables.append(table)
    if not tables or len({t.dtype for t in tables}) > 1:
        return None
    row_adapter = np.full(num_rows, -1, dtype=np.int32)
    for index, group in enumerate(small):
        for start, end in group.segments.tolist():
            row_adapter[start:end] = index
        group.in_table = True
    return StepLora(tables, row_adapter)
