"""The compiled core (mypyc; make setup runs scripts/build_native.py) is the one in use when it
was built, and was built from the sources as they are: an edited ``.py`` whose stale ``.so``
still shadows it fails here (run ``make setup``) instead of quietly running the old code."""

from __future__ import annotations

from asyncengine.compiled import (
    COMPILED_MODULES,
    build_record,
    compiled_now,
    core_kind,
    extension_path,
    stale_modules,
)


def test_the_built_modules_run_compiled_from_their_current_sources() -> None:
    record = build_record()
    if record is None:  # never built (an install without make): no extension shadows a .py
        assert [name for name in COMPILED_MODULES if extension_path(name).exists()] == []
        assert compiled_now() == [] and core_kind() == "interpreted"
        return
    assert sorted(record) == sorted(COMPILED_MODULES), "the list changed: run make setup"
    assert stale_modules() == [], "edited since the build (the .so shadows it): run make setup"
    assert compiled_now() == list(COMPILED_MODULES) and core_kind() == "compiled"
