"""A process that imported Triton (torch's dynamo imports it; transformers imports dynamo) and
asyncengine exits without nanobind's ``leaked ...`` lines, and its own stderr still shows."""

from __future__ import annotations

import subprocess
import sys

from tests.python_subprocess import REPO_ROOT


def test_exit_after_importing_triton_is_quiet() -> None:
    code = (
        "import sys, torch._dynamo, asyncengine\n"
        "assert 'triton' in sys.modules\n"
        "print('still shown', file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "still shown" in result.stderr
    assert "nanobind" not in result.stderr, result.stderr[-2000:]


def test_an_uncaught_exception_is_still_printed() -> None:
    code = "import torch._dynamo, asyncengine\nraise RuntimeError('bad things')\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert "RuntimeError: bad things" in result.stderr
    assert "nanobind" not in result.stderr
