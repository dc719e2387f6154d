"""PageTable: one row of page ids per live request (numpy int32, no torch).

The token slot of position ``p`` of the request in row ``r`` is
``array[r, p // page_size] * page_size + p % page_size``.

Two tables exist in a running engine, one per side of the plan boundary: the KV cache manager's
(``record_writes=True``: every write is also logged, and the scheduler moves the log into the
next plan with ``drain_writes``, and the rows it releases with ``drain_released``) and the
executor's own, which ``apply``-s each plan's writes
before its forward. Nothing else is shared between them. A simulated engine's executor keeps no
table: its manager's table keeps rows only (``rows_only``), its writes checked, not stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mypy_extensions import mypyc_attr

from asyncengine.common.plan import PageWrite

# writes of at most this many pages go item by item (a decode step's new pages: a few)
_FEW_WRITES = 16


@mypyc_attr(native_class=False)  # mypyc compiles only some builtin bases
class OutOfRowsError(RuntimeError):
    """Every page-table row is taken (more live requests than ``max_rows``)."""


class PageTable:
    def __init__(
        self, max_rows: int, max_pages_per_row: int, *, record_writes: bool = False
    ) -> None:
        if max_rows <= 0 or max_pages_per_row <= 0:
            raise ValueError(
                f"max_rows and max_pages_per_row must be positive, "
                f"got {max_rows} and {max_pages_per_row}"
            )
        self.array = np.zeros((max_rows, max_pages_per_row), dtype=np.int32)
        self._max_pages_per_row = max_pages_per_row  # asked per extend: a plain int
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._in_use = np.zeros(max_rows, dtype=np.bool_)
        self._writes: list[PageWrite] | None = [] if record_writes else None
        self._released: list[int] = []  # rows released since the last drain (recording only)
        self.stores_pages = True  # False: rows only (rows_only)

    @classmethod
    def contiguous(cls, rows: int, pages_per_row: int) -> PageTable:
        """Rows 0..rows-1 each holding its own run of pages (row r: pages r*n .. r*n+n-1), as
        the benchmarks that time a forward over a filled pool lay them out."""
        table = cls(rows, pages_per_row)
        for row in range(rows):
            first = row * pages_per_row
            table.set_pages(row, 0, list(range(first, first + pages_per_row)))
        return table

    def rows_only(self) -> None:
        """From now on keep the rows only: page writes are checked (the same errors) but
        neither stored nor logged, and ``row_pages`` refuses. For a table whose plans no
        executor reads pages from (the simulator's: sim/simulator.py)."""
        self.stores_pages = False
        if self._writes is not None:
            self._writes = []

    @property
    def max_rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def max_pages_per_row(self) -> int:
        return self._max_pages_per_row

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        """Take a free row (lowest ids first)."""
        if not self._free_rows:
            raise OutOfRowsError(f"all {self.max_rows} page-table rows are in use")
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def release(self, row: int) -> None:
        if not 0 <= row < self.max_rows or not self._in_use[row]:
            raise ValueError(f"page-table row {row} is not in use")
        self._in_use[row] = False
        self._free_rows.append(row)
        if self._writes is not None:
            self._released.append(row)

    def is_in_use(self, row: int) -> bool:
        return bool(self._in_use[row])

    def set_pages(self, row: int, start: int, pages: Sequence[int] | np.ndarray) -> None:
        """Write ``pages`` into ``row`` from page index ``start`` on."""
        array = np.asarray(pages, dtype=np.int32) if self.stores_pages else None
        end = start + (len(pages) if array is None else array.size)
        if start < 0 or end > self.max_pages_per_row:
            raise ValueError(
                f"pages {start}..{end - 1} exceed the row width {self.max_pages_per_row}"
            )
        if array is None:  # rows only
            return
        self.array[row, start:end] = array
        if self._writes is not None:
            self._writes.append(PageWrite(row, start, array.tolist()))

    def set_page(self, row: int, index: int, page: int) -> None:
        """Write one page id into ``row`` at page index ``index`` (``set_pages`` for one)."""
        if not 0 <= index < self._max_pages_per_row:
            raise ValueError(f"page {index} exceeds the row width {self._max_pages_per_row}")
        if not self.stores_pages:
            return
        self.array[row, index] = page
        writes = self._writes
        if writes is not None:
            writes.append(PageWrite(row, index, [page]))

    def set_each(self, rows: Sequence[int], indexes: Sequence[int], pages: Sequence[int]) -> None:
        """``set_page(rows[k], indexes[k], pages[k])`` for each ``k`` in order, in one write
        (the same table and the same log)."""
        if not indexes:
            return
        if min(indexes) < 0 or max(indexes) >= self._max_pages_per_row:
            raise ValueError(f"a page index exceeds the row width {self._max_pages_per_row}")
        if not self.stores_pages:
            return
        array = self.array
        if len(indexes) <= _FEW_WRITES:  # item by item: a fancy-indexed write costs ~6 us
            for row, index, page in zip(rows, indexes, pages, strict=True):
                array[row, index] = page
        else:
            array[rows, indexes] = pages
        writes = self._writes
        if writes is not None:
            writes.extend(
                [
                    PageWrite(row, index, [page])
                    for row, index, page in zip(rows, indexes, pages, strict=True)
                ]
            )

    def row_pages(self, row: int, num_pages: int) -> np.ndarray:
        """A read-only view of the first ``num_pages`` entries of ``row``."""
        if not self.stores_pages:
            raise RuntimeError("this page table keeps rows only (rows_only)")
        view = self.array[row, :num_pages]
        view.flags.writeable = False
        return view

    def drain_writes(self) -> list[PageWrite]:
        """The writes since the last drain, oldest first (recording tables only)."""
        if self._writes is None:
            raise RuntimeError("this page table does not record its writes")
        writes, self._writes = self._writes, []
        return writes

    def drain_released(self) -> list[int]:
        """The rows released since the last drain, oldest first (recording tables only)."""
        released, self._released = self._released, []
        return released

    def requeue_released(self, rows: Sequence[int]) -> None:
        """Put drained released rows back in front of the log (their plan's forward failed)."""
        self._released[:0] = rows

    def requeue(self, writes: Sequence[PageWrite]) -> None:
        """Put drained writes back in front of the log: their plan never reached the executor's
        table (its forward failed first), and nothing drained after it has either."""
        if self._writes is None:
            raise RuntimeError("this page table does not record its writes")
        self._writes[:0] = writes

    def apply(self, writes: Sequence[PageWrite]) -> None:
        """Replay another table's writes, in order."""
        for write in writes:
            self.array[write.row, write.start : write.start + len(write.pages)] = write.pages

    def reset(self) -> None:
        if self._writes is not None:  # every row in use is released too
            self._released.extend(np.flatnonzero(self._in_use).tolist())
        self.array[:] = 0
        self._in_use[:] = False
        self._free_rows = list(range(self.max_rows - 1, -1, -1))
        if self._writes is not None:
            self._writes = []
