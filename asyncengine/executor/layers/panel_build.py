"""A projection's int8 panels (kernels/cpu/cpu_quant_i8gemm.c) packed a row range at a time, so
that the engine can build them between steps after start-up instead of in its first many-row
product (~1.7 s for a 1.5B model on two cores: the whole model's panels).

Each part's panels are allocated whole at the first range (the bytes the product will hold, no
more), then filled ``UNIT_BYTES`` of panels per ``step``: a step that arrives while a build runs
waits for one range at most (~5 ms). The ranges start at multiples of the panel width, so a
range's panels are those of the whole weight: the bytes are the same as one ``pack`` call's.
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
    """The panels of ``parts`` (each one ``takes``), filled by ``step`` until ``done``."""

    __slots__ = ("_todo", "panels", "parts")

    def __init__(self, parts: Sequence[QuantizedTensor], unit_bytes: int | None = None) -> None:
        unit_bytes = UNIT_BYTES if unit_bytes is None else unit_bytes
        self.parts = list(parts)
        self.panels: list[I8Panels] | None = None  # allocated at the first step
        self._todo: deque[tuple[int, int, int]] = deque()  # (part, first row, end row)
        for index, part in enumerate(self.parts):
            rows = part.shape[0]
            panel_bytes = quant_i8gemm_native.packed_bytes(part) // -(-rows // PANEL_COLUMNS)
            step_rows = max(1, unit_bytes // panel_bytes) * PANEL_COLUMNS
            for start in range(0, rows, step_rows):
                self._todo.append((index, start, min(rows, start + step_rows)))

    @property
    def nbytes(self) -> int:
        return sum(quant_i8gemm_native.packed_bytes(p) for p in self.parts)

    @property
    def done(self) -> bool:
        return not self._todo

    def step(self) -> None:
        """Pack the next row range (the first allocates every part's panels)."""
        if self.panels is None:
            self.panels = [quant_i8gemm_native.empty_panels(p) for p in self.parts]
        index, start, end = self._todo.popleft()
        part = self.parts[index]
        rows = QuantizedTensor(part.format, part.data[start:end], part.cols, part.interleaved)
        first = start // PANEL_COLUMNS
        out = self.panels[index].data[first : first + -(-(end - start) // PANEL_COLUMNS)]
        quant_i8gemm_native.pack(rows, out)

    def finish(self) -> list[I8Panels]:
        """Pack what is left; the panels."""
        while self._todo:
            self.step()
        if self.panels is None:  # no rows at all
            self.panels = [quant_i8gemm_native.empty_panels(p) for p in self.parts]
        return self.panels
