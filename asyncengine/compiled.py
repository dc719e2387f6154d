"""The modules that ``make setup`` compiles with mypyc (scripts/build_native.py), and whether
this process runs them compiled.

mypyc turns these type-annotated modules into C extensions (native classes with struct
attributes, direct calls between them): the scheduler, the KV cache and the simulator's step
loop. Each ``.so`` sits beside its ``.py`` and Python imports it first; without the ``.so`` the
same ``.py`` runs interpreted, with identical results. The build records each source's hash,
so a ``.py`` edited after the build (its ``.so`` stale) is told apart from a fresh one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

COMPILED_MODULES: tuple[str, ...] = (
    "asyncengine.bench.records",
    "asyncengine.cache.allocator",
    "asyncengine.cache.manager",
    "asyncengine.cache.page_table",
    "asyncengine.cache.prompt_scores",
    "asyncengine.cache.radix_cache",
    "asyncengine.cache.tail_pages",
    "asyncengine.common.plan",
    "asyncengine.common.request",
    "asyncengine.core.lifecycle",
    "asyncengine.scheduler.admission",
    "asyncengine.scheduler.prefill",
    "asyncengine.scheduler.prompt_scoring",
    "asyncengine.scheduler.retraction",
    "asyncengine.scheduler.scheduler",
    "asyncengine.scheduler.step_events",
    "asyncengine.scheduler.step_prefixes",
    "asyncengine.scheduler.step_shares",
    "asyncengine.scheduler.waiting_queue",
    "asyncengine.sim.bulk_decode",
    "asyncengine.sim.clock",
    "asyncengine.sim.closed_admission",
    "asyncengine.sim.simulated_executor",
    "asyncengine.sim.simulator",
    "asyncengine.sim.workload_replay",
)

PACKAGE = Path(__file__).resolve().parent
# what the last build compiled, with each source's hash (written by scripts/build_native.py)
BUILD_RECORD = PACKAGE / "compiled.json"


def source_path(module: str) -> Path:
    """The ``.py`` of one of COMPILED_MODULES (all live under ``asyncengine/``)."""
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def extension_path(module: str) -> Path:
    """Where its compiled extension goes (beside the ``.py``, this Python's suffix)."""
    return source_path(module).with_suffix(EXTENSION_SUFFIXES[0])


def source_hash(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


def compiled_now() -> list[str]:
    """Those of COMPILED_MODULES that this process imports from a compiled extension."""
    return [
        name
        for name in COMPILED_MODULES
        if not str(importlib.import_module(name).__file__).endswith(".py")
    ]


def core_kind() -> str:
    """``compiled``: every module of the list runs compiled; ``interpreted``: none does;
    ``mixed``: some do (a build in progress or a partial one)."""
    done = len(compiled_now())
    return "compiled" if done == len(COMPILED_MODULES) else "interpreted" if not done else "mixed"


def build_record() -> dict[str, str] | None:
    """Module -> source hash at the last build, None when nothing was built."""
    if not BUILD_RECORD.exists():
        return None
    record: dict[str, str] = json.loads(BUILD_RECORD.read_text())["sources"]
    return record


def stale_modules() -> list[str]:
    """Compiled modules whose ``.py`` changed since the build (their ``.so`` shadows the edit)."""
    record = build_record() or {}
    return [name for name, digest in record.items() if source_hash(name) != digest]
