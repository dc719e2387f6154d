"""PageAllocator: the free list of KV page ids.

Pages are ``0 .. num_pages - 1``. A mask of allocated pages catches double frees and frees of
pages that were never handed out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mypy_extensions import mypyc_attr

# frees of at most this many pages are checked with Python ints (quicker than the numpy checks
# up to ~1,000 pages: an eviction for a prompt frees tens to hundreds)
_SMALL = 1024


@mypyc_attr(native_class=False)  # mypyc compiles only some builtin bases
class OutOfPagesError(RuntimeError):
    """Not enough free KV pages for an allocation (the caller may evict, wait or retract)."""


class InvalidFreeError(ValueError):
    """A free of pages that are out of range, not allocated, or listed twice."""


class PageAllocator:
    """Free list of page ids kept as a stack (a Python list: a step takes or returns a few
    pages, which list operations do quicker than numpy calls).

    ``alloc`` takes from the stack's top, ``free`` pushes back, so a just-freed page is the
    next one handed out (LIFO). The allocated mask is a ``bytearray`` with a numpy view of the
    same memory: small frees check it with Python ints, large ones with numpy.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self._num_pages = num_pages
        self._stack: list[int] = []
        self._flags = bytearray(num_pages)  # 1: allocated
        self._allocated = np.frombuffer(self._flags, dtype=np.bool_)  # a view, not a copy
        self.reset()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._stack)

    @property
    def num_allocated(self) -> int:
        return self._num_pages - len(self._stack)

    def reset(self) -> None:
        """Mark every page free; the first allocations return 0, 1, 2, ..."""
        self._stack = list(range(self._num_pages - 1, -1, -1))
        self._allocated[:] = False

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` pages; returns an int32 array of their ids."""
        return np.array(self.alloc_ids(n), dtype=np.int32)

    def alloc_ids(self, n: int) -> list[int]:
        """``alloc`` as a list of Python ints (the same pages)."""
        stack = self._stack
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(stack):
            raise OutOfPagesError(
                f"asked for {n} KV pages but only {len(stack)} of {self._num_pages} are free"
            )
        start = len(stack) - n
        pages = stack[start:]
        del stack[start:]
        pages.reverse()
        flags = self._flags
        for page in pages:
            flags[page] = 1
        return pages

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Return pages to the free list; raises InvalidFreeError and changes nothing if any
        page is out of range, not currently allocated, or listed twice."""
        array = pages if isinstance(pages, np.ndarray) else np.asarray(pages)
        if array.size == 0:
            return
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InvalidFreeError(
                f"pages must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}"
            )
        self.free_ids(array.tolist())

    def free_ids(self, ids: list[int]) -> None:
        """``free`` for a list of Python ints (a sequence's own pages): the same checks."""
        if not ids:
            return
        # a few pages (the usual free) check quicker as Python ints than by numpy calls
        if len(ids) > _SMALL:
            self._free_many(np.asarray(ids))
            return
        flags, num_pages = self._flags, self._num_pages
        for i, page in enumerate(ids):
            # out of range, not allocated, or listed twice (its flag cleared a moment ago)
            if not 0 <= page < num_pages or not flags[page]:
                for done in ids[:i]:  # as it was: nothing changed
                    flags[done] = 1
                self._free_many(np.asarray(ids))  # raises, saying which pages
                return
            flags[page] = 0
        self._stack.extend(ids)

    def _free_many(self, array: np.ndarray) -> None:
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
        values, counts = np.unique(array, return_counts=True)
        if values.size != array.size:
            raise InvalidFreeError(
                f"pages listed more than once in one free: {values[counts > 1][:8].tolist()}"
            )
        self._allocated[array] = False
        self._stack.extend(array.tolist())

    def is_allocated(self, page: int) -> bool:
        return bool(self._flags[page])

    def free_pages(self) -> np.ndarray:
        """A copy of the free page ids (for invariant checks)."""
        return np.array(self._stack, dtype=np.int32)

    def allocated_mask(self) -> np.ndarray:
        """A copy of the boolean mask of allocated pages (for invariant checks)."""
        mask: np.ndarray = self._allocated.copy()
        return mask
