"""A projection's int8 panels (kernels/cpu/cpu_quant_i8gemm.c) packed a row range at a time, so
that the engine can build them between steps after start-up instead of in its first many-row
product (~1.7 s for a 1.5B model on two cores: the whole model's panels).

Each part's panels are allocated whole at the first range (the bytes the product will hold, no
more), then filled ``UNIT_BYTES`` of panels per ``step``: a step that arrives while a build runs
waits for one range at most (~5 ms). The ranges start at multiples of the panel width, so a
range's panels are those of the whole weight: the bytes are the same as one ``pack`` call's.
Consecutive parts of one panel family (``quant_i8gemm_native.PANEL_FAMILIES``: a Q5_0 q / k
beside a Q8_0 v) whose rows fill whole panels share one panel set, so the product makes one call
for them, quantizing the activations once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from asyncengine.kernels.cpu import quant_i8gemm_native
from asyncengine.kernels.cpu.quant_i8gemm_native import PANEL_COLUMNS, I8Panels
from asyncengine.kernels.quant_formats import QuantizedTensor

# Panel bytes packed per step: ~5 ms on two AVX-512 cores (a 1.5B model's 1.2 GB in ~1.7 s;
# scripts/bench_real_sizes.py --startup-only)
UNIT_BYTES = 4 << 20
WHOLE_PARTS = 1 << 62  # as ``unit_bytes``: one range a part (a build done in one go)


class PanelBuild:
    """The panels of ``parts`` (each one ``takes``), filled by ``step`` until ``done``: one
    panel set a run of parts that share it (``panel_sets``)."""

    __slots__ = ("_sets", "_todo", "panels", "parts")

    def __init__(self, parts: Sequence[QuantizedTensor], unit_bytes: int | None = None) -> None:
        unit_bytes = UNIT_BYTES if unit_bytes is None else unit_bytes
        self.parts = list(parts)
        self._sets = panel_sets(self.parts)
        self.panels: list[I8Panels] | None = None  # allocated at the first step
        # (panel set, part, the part's first panel in its set, first row, end row)
        self._todo: deque[tuple[int, int, int, int, int]] = deque()
        for set_index, members in enumerate(self._sets):
            first_panel = 0
            for index in members:
                part = self.parts[index]
                rows = part.shape[0]
                panels = -(-rows // PANEL_COLUMNS)
                panel_bytes = quant_i8gemm_native.packed_bytes(part) // panels
                step_rows = max(1, unit_bytes // panel_bytes) * PANEL_COLUMNS
                for start in range(0, rows, step_rows):
                    end = min(rows, start + step_rows)
                    self._todo.append((set_index, index, first_panel, start, end))
                first_panel += panels

    @property
    def nbytes(self) -> int:
        return sum(quant_i8gemm_native.packed_bytes(p) for p in self.parts)

    @property
    def done(self) -> bool:
        return not self._todo

    def _allocate(self) -> list[I8Panels]:
        return [
            quant_i8gemm_native.empty_panels(
                self.parts[members[0]], sum(self.parts[i].shape[0] for i in members)
            )
            for members in self._sets
        ]

    def step(self) -> None:
        """Pack the next row range (the first allocates every panel set)."""
        if self.panels is None:
            self.panels = self._allocate()
        set_index, index, first_panel, start, end = self._todo.popleft()
        part = self.parts[index]
        rows = QuantizedTensor(part.format, part.data[start:end], part.cols, part.interleaved)
        first = first_panel + start // PANEL_COLUMNS
        out = self.panels[set_index].data[first : first + -(-(end - start) // PANEL_COLUMNS)]
        quant_i8gemm_native.pack(rows, out)

    def finish(self) -> list[I8Panels]:
        """Pack what is left; the panel sets, in the parts' order."""
        while self._todo:
            self.step()
        if self.panels is None:  # no rows at all
            self.panels = self._allocate()
        return self.panels


def panel_sets(parts: Sequence[QuantizedTensor]) -> list[list[int]]:
    """The parts' indexes, in runs that share one panel set: one panel family, and every part
    but a run's last of whole panels (so that the next one's panels start on a panel)."""
    sets: list[list[int]] = []
    for index, part in enumerate(parts):
        if sets:
            last = parts[sets[-1][-1]]
            family = quant_i8gemm_native.panel_family
            if family(last) == family(part) and last.shape[0] % PANEL_COLUMNS == 0:
                sets[-1].append(index)
                continue
        sets.append([index])
    return sets
