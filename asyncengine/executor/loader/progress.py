"""Progress reporting for loads and conversions: a tqdm bar on a terminal, log lines always."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

log = logging.getLogger("asyncengine.loader")

T = TypeVar("T")


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a bar on an interactive stderr; silent elsewhere (logs and CI stay clean)."""
    interactive = sys.stderr.isatty()
    yield from tqdm(items, desc=description, total=total, disable=not interactive, leave=False)
