"""The modules that ``make setup`` compiles with mypyc (scripts/build_native.py), and whether
this process runs them compiled.

mypyc turns these type-annotated modules into C extensions (native classes with struct
attributes, direct calls between them): the scheduler, the KV cache and the simulator's step
loop. Each ``.so`` sits beside its ``.py`` and Python imports it first; without the ``.so`` the
same ``.py`` runs interpreted, with identical results. The build records each source's hash,
so a ``.py`` edited after the build (its ``.so`` stale) is told apart from a fresh one: then
the whole list is imported from its ``.py`` files (``run_edits_interpreted``, called first
thing by ``asyncengine/__init__.py``), with one warning naming the edited modules, until
``make setup`` builds again. The whole list, not only the edited module: mypyc compiles them
as one group whose modules call each other's compiled code directly, so a stale module loaded
from its ``.py`` would still run compiled wherever the others call it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from pathlib import Path
from types import ModuleType

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
    "asyncengine.scheduler.admitter",
    "asyncengine.scheduler.plan_ahead",
    "asyncengine.scheduler.prefill",
    "asyncengine.scheduler.prompt_scoring",
    "asyncengine.scheduler.retraction",
    "asyncengine.scheduler.scheduler",
    "asyncengine.scheduler.speculation",
    "asyncengine.scheduler.step_commit",
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


def source_hash(module: str) -> str | None:
    """The hash of the module's ``.py`` (None: there is no such file)."""
    path = source_path(module)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


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
    """Modules whose ``.py`` changed since the build (their ``.so`` would shadow the edit), or
    that the build did not compile or compiled from a source gone now (the list changed)."""
    record = build_record()
    if record is None:
        return []
    names = sorted(set(record) | set(COMPILED_MODULES))
    return [name for name in names if record.get(name) != source_hash(name)]


class StaleBuildWarning(UserWarning):
    """A compiled module was edited since the build: the compiled core runs interpreted."""


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports COMPILED_MODULES from their ``.py`` files, ahead of the ``.so`` beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in COMPILED_MODULES:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


# the modules edited since the build when this process started (empty: none, or no build)
_edited: list[str] = []


def run_edits_interpreted() -> list[str]:
    """When a compiled module was edited since the build, import every one of them from its
    ``.py`` (before any of them is imported) and warn once, naming the edited ones. Returns
    them (empty when the build is current, or there is none)."""
    if any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        return _edited
    stale = stale_modules()
    if stale:
        _edited[:] = stale
        sys.meta_path.insert(0, _SourceFinder())
        warnings.warn(
            f"edited since the compiled build: {', '.join(stale)}; the compiled core runs "
            "interpreted until make setup (scripts/build_native.py --if-stale) builds it again",
            StaleBuildWarning,
            stacklevel=2,
        )
    return _edited


def edited_since_build() -> list[str]:
    """The compiled modules found edited since the build when this process started: while
    any is, all of COMPILED_MODULES run interpreted."""
    return list(_edited)
