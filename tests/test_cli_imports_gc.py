"""The CLI imports its commands' modules with the garbage collector off, then puts it back."""

from __future__ import annotations

import gc

import pytest

from asyncengine import cli


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_while_importing_and_back_as_it_was_after(enabled: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with cli.collector_paused_for_imports():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        assert cli._imports_frozen and gc.get_freeze_count() > 0  # the first time: frozen
        frozen = gc.get_freeze_count()
        with cli.collector_paused_for_imports():
            _ = [[] for _ in range(10)]  # tracked objects made meanwhile: not frozen
        assert gc.get_freeze_count() == frozen
    finally:
        (gc.enable if was else gc.disable)()


def test_the_collector_is_back_after_an_import_fails() -> None:
    with pytest.raises(ImportError), cli.collector_paused_for_imports():
        raise ImportError("a module missing")
    assert gc.isenabled()
