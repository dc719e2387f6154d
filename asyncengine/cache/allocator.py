"""PageAllocator: a numpy free list of KV page ids.

Pages are ``0 .. num_pages - 1``. ``alloc`` and ``free`` are vectorized (no Python loop over
pages); a boolean mask of allocated pages catches double frees and frees of pages that were
never handed out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SMALL = 64  # frees of at most this many pages are checked with Python ints


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages for an allocation (the caller may evict, wait or retract)."""


class InvalidFreeError(ValueError):
    """A free of pages that are out of range, not allocated, or listed twice."""


class PageAllocator:
    """Free list of page ids kept as a stack in a numpy array.

    The stack's live part is ``_stack[:_num_free]``; ``alloc`` takes from its top, ``free``
    pushes back, so a just-freed page is the next one handed out (LIFO).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self._num_pages = num_pages
        self._stack = np.empty(num_pages, dtype=np.int32)
        self._allocated = np.zeros(num_pages, dtype=np.bool_)
        self._num_free = 0
        self.reset()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_allocated(self) -> int:
        return self._num_pages - self._num_free

    def reset(self) -> None:
        """Mark every page free; the first allocations return 0, 1, 2, ..."""
        self._stack[:] = np.arange(self._num_pages - 1, -1, -1, dtype=np.int32)
        self._allocated[:] = False
        self._num_free = self._num_pages

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` pages; returns an int32 array of their ids."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._num_free:
            raise OutOfPagesError(
                f"asked for {n} KV pages but only {self._num_free} of {self._num_pages} are free"
            )
        start = self._num_free - n
        pages: np.ndarray = self._stack[start : self._num_free][::-1].copy()
        self._num_free = start
        self._allocated[pages] = True
        return pages

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Return pages to the free list; raises InvalidFreeError and changes nothing if any
        page is out of range, not currently allocated, or listed twice."""
        array = np.asarray(pages)
        if array.size == 0:
            return
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise InvalidFreeError(
                f"pages must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}"
            )
        # a few pages (the usual free) check quicker as Python ints than by numpy reductions
        small = array.tolist() if array.size <= _SMALL else None
        if small is not None:
            low, high = min(small), max(small)
        else:
            low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self._num_pages:
            bad = array[(array < 0) | (array >= self._num_pages)]
            raise InvalidFreeError(
                f"page ids out of range 0..{self._num_pages - 1}: {bad[:8].tolist()}"
            )
        was_allocated = self._allocated[array]
        if not was_allocated.all():
            bad = array[~was_allocated]
            raise InvalidFreeError(
                f"freeing pages that are not allocated (double free or never allocated): "
                f"{bad[:8].tolist()}"
            )
        if small is not None:
            repeated = len(set(small)) != len(small)
        else:
            repeated = np.unique(array).size != array.size
        if repeated:
            values, counts = np.unique(array, return_counts=True)
            raise InvalidFreeError(
                f"pages listed more than once in one free: {values[counts > 1][:8].tolist()}"
            )
        self._allocated[array] = False
        end = self._num_free + array.size
        self._stack[self._num_free : end] = array
        self._num_free = end

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def free_pages(self) -> np.ndarray:
        """A copy of the free page ids (for invariant checks)."""
        pages: np.ndarray = self._stack[: self._num_free].copy()
        return pages

    def allocated_mask(self) -> np.ndarray:
        """A copy of the boolean mask of allocated pages (for invariant checks)."""
        mask: np.ndarray = self._allocated.copy()
        return mask
