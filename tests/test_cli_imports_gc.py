"""The CLI imports its commands' modules with the garbage collector off, then puts it back."""

from __future__ import annotations

import gc

import pytest

from asyncengine import cli
from tests.python_subprocess import run_python

# in a fresh interpreter: the suite's own process may have run ``main`` (frozen once) already
FIRST_PAUSE = """
import gc, sys
from asyncengine import cli
(gc.enable if sys.argv[1] == "on" else gc.disable)()
with cli.collector_paused_for_imports():
    assert not gc.isenabled()
assert gc.isenabled() == (sys.argv[1] == "on")
assert cli._imports_frozen and gc.get_freeze_count() > 0  # the first time: frozen
frozen = gc.get_freeze_count()
with cli.collector_paused_for_imports():
    made = [[] for _ in range(10)]  # tracked objects made meanwhile: not frozen
assert gc.get_freeze_count() == frozen
print("ok")
"""


@pytest.mark.parametrize("enabled", ["on", "off"])
def test_the_collector_is_off_while_importing_and_back_as_it_was_after(enabled: str) -> None:
    assert run_python(FIRST_PAUSE, enabled).strip() == "ok"


def test_the_collector_is_back_after_an_import_fails() -> None:
    with pytest.raises(ImportError), cli.collector_paused_for_imports():
        raise ImportError("a module missing")
    assert gc.isenabled()
