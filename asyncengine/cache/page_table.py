"""PageTable: one row of page ids per live request, as an int32 CPU tensor.

The token slot of position ``p`` of the request in row ``r`` is
``table[r, p // page_size] * page_size + p % page_size``. Writes go through a numpy view that
shares the tensor's memory, so they are vectorized and cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class OutOfRowsError(RuntimeError):
    """Every page-table row is taken (more live requests than ``max_requests``)."""


class PageTable:
    def __init__(self, max_requests: int, max_pages_per_request: int) -> None:
        if max_requests <= 0 or max_pages_per_request <= 0:
            raise ValueError(
                f"max_requests and max_pages_per_request must be positive, "
                f"got {max_requests} and {max_pages_per_request}"
            )
        self.table = torch.zeros((max_requests, max_pages_per_request), dtype=torch.int32)
        self._array = self.table.numpy()  # shares memory with self.table
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._in_use = np.zeros(max_requests, dtype=np.bool_)

    @property
    def max_requests(self) -> int:
        return self._array.shape[0]

    @property
    def max_pages_per_request(self) -> int:
        return self._array.shape[1]

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        """Take a free row (lowest ids first)."""
        if not self._free_rows:
            raise OutOfRowsError(f"all {self.max_requests} page-table rows are in use")
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def release(self, row: int) -> None:
        if not 0 <= row < self.max_requests or not self._in_use[row]:
            raise ValueError(f"page-table row {row} is not in use")
        self._in_use[row] = False
        self._free_rows.append(row)

    def is_in_use(self, row: int) -> bool:
        return bool(self._in_use[row])

    def set_pages(self, row: int, start: int, pages: np.ndarray | Sequence[int]) -> None:
        """Write ``pages`` into ``row`` from page index ``start`` on."""
        array = np.asarray(pages, dtype=np.int32)
        end = start + array.size
        if start < 0 or end > self.max_pages_per_request:
            raise ValueError(
                f"pages {start}..{end - 1} exceed the row width {self.max_pages_per_request}"
            )
        self._array[row, start:end] = array

    def row_pages(self, row: int, num_pages: int) -> np.ndarray:
        """A read-only view of the first ``num_pages`` entries of ``row``."""
        view = self._array[row, :num_pages]
        view.flags.writeable = False
        return view

    def reset(self) -> None:
        self._array[:] = 0
        self._in_use[:] = False
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
