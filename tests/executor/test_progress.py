"""Load/convert progress: a bar weighted by size on a terminal, INFO lines elsewhere."""

from __future__ import annotations

import io
import logging

import pytest

from asyncengine.executor.loader import progress as progress_module
from asyncengine.executor.loader.progress import LOG_EVERY_SECONDS, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_advances_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", screen)
    sizes = {"embed": 9000, "a": 500, "b": 500}
    items = list(progress(sizes, "converting model.gguf", total=3, size=sizes.__getitem__))
    assert items == ["embed", "a", "b"]
    shown = screen.getvalue()
    assert "converting model.gguf" in shown
    assert "/10.0k" in shown  # the bar counts the items' sizes (10000), not the items (3)


def test_without_a_terminal_long_runs_log_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())
    now = [0.0]

    def clock() -> float:
        now[0] += LOG_EVERY_SECONDS / 2  # each item takes half the logging period
        return now[0]

    caplog.set_level(logging.INFO, logger="asyncengine.loader")
    list(progress(range(8), "converting model.gguf", total=8, clock=clock))
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("converting model.gguf: ") for line in lines)
    assert len(lines) == 4  # every other item once a period has passed
    assert lines[-1].startswith("converting model.gguf: 100%")


def test_without_a_terminal_short_runs_stay_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger="asyncengine.loader")
    assert list(progress([1, 2, 3], "loading", total=3)) == [1, 2, 3]
    assert caplog.records == []
