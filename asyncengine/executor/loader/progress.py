"""Progress of loads and conversions: a tqdm bar on a terminal, log lines elsewhere.

Bars advance by what each item weighs when ``size`` is given (a GGUF's embedding table is most
of the conversion's time; a bar counting tensors would sit at 0% while it dequantizes).
Without a terminal (a log file, a pipe, CI) a long run writes an INFO line every
``LOG_EVERY_SECONDS`` instead, and a short one writes nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

log = logging.getLogger("asyncengine.loader")

T = TypeVar("T")

LOG_EVERY_SECONDS = 3.0


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def progress(
    items: Iterable[T],
    description: str,
    total: int | None = None,
    size: Callable[[T], int] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[T]:
    """Iterate ``items`` (``total`` of them), showing how far along ``description`` is."""
    listed = list(items) if size is not None else None
    weights = [size(item) for item in listed] if size is not None and listed is not None else None
    source: Iterable[T] = listed if listed is not None else items
    if sys.stderr.isatty():
        yield from _bar(source, description, total, weights)
    else:
        yield from _logged(source, description, total, weights, clock)


def _bar(
    items: Iterable[T], description: str, total: int | None, weights: list[int] | None
) -> Iterator[T]:
    if weights is None:
        yield from tqdm(items, desc=description, total=total, leave=False)
        return
    with tqdm(total=sum(weights), desc=description, unit_scale=True, leave=False) as bar:
        for item, weight in zip(items, weights, strict=True):
            yield item
            bar.update(weight)


def _logged(
    items: Iterable[T],
    description: str,
    total: int | None,
    weights: list[int] | None,
    clock: Callable[[], float],
) -> Iterator[T]:
    whole = sum(weights) if weights is not None else total
    done = 0
    start = last = clock()
    for i, item in enumerate(items):
        yield item
        done += weights[i] if weights is not None else 1
        now = clock()
        if now - last >= LOG_EVERY_SECONDS and whole:
            last = now
            log.info("%s: %.0f%% after %.0f s", description, 100 * done / whole, now - start)
