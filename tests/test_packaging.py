"""What an installed asyncengine carries besides its modules: checked in a wheel built from
the sources, as a user's install gets it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_typed_marker(tmp_path: Path) -> None:
    # a copy of what the build reads, so the build leaves nothing in the checkout
    source = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "compiled.json")
    for name in ("asyncengine", "policies", "kernels"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("asyncengine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "asyncengine/py.typed" in names
    assert "asyncengine/policies/base.py" in names  # the policy interface it types
