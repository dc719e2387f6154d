"""Run a Python script in a fresh interpreter with the repository importable.

tests/conftest.py puts Triton in interpreter mode for the test process; scripts that need the
compiled kernels (GPU checks, compiling for sm_90) run in a child without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(
    code: str,
    *args: str,
    interpret: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> str:
    """The script's stdout; a non-zero exit fails the test with the end of its stderr.

    ``interpret`` keeps Triton's interpreter on in the child; ``env`` adds variables.
    """
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        child["TRITON_INTERPRET"] = "1"
    child["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), child.get("PYTHONPATH", "")])
    child.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=child,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
