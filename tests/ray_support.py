"""Helpers of the Ray tests: a small local Ray, bounded teardown, replica processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

OBJECT_STORE_BYTES = 128 * 1024 * 1024


def start_local_ray(num_cpus: int = 2) -> None:
    from asyncengine.api.ray_local import init_ray

    init_ray(num_cpus=num_cpus, object_store_bytes=OBJECT_STORE_BYTES)


def stop_local_ray(timeout: float = 30.0) -> None:
    """Serve and Ray down, never waiting more than ``timeout`` on Serve."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    worker = threading.Thread(target=serve.shutdown, daemon=True)
    worker.start()
    worker.join(timeout)
    ray.shutdown()


def canonical(labels: Sequence[str | int]) -> list[int]:
    """Replica labels renamed by first appearance: two runs route alike iff these are equal."""
    names: dict[str | int, int] = {}
    return [names.setdefault(label, len(names)) for label in labels]


def descendants(pid: int) -> Iterator[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            yield child
            stack.append(child)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
