#!/usr/bin/env python
"""Type-check the package as it is installed (``policies/`` and ``kernels/`` under
``asyncengine``): mypy cannot follow setuptools' editable-install mapping, so the installed
layout is laid out as a tree of symlinks, mypy checks it, and paths are mapped back.

    python scripts/typecheck.py        (make lint runs it; settings in pyproject.toml)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / ".mypy_tree"
MAPPED = {
    "asyncengine": "asyncengine",
    "asyncengine/policies": "policies",
    "asyncengine/kernels": "kernels",
}


def link_tree(tree: Path = TREE) -> None:
    """The installed layout under ``tree`` (scripts/build_native.py compiles in one too)."""
    shutil.rmtree(tree, ignore_errors=True)
    for installed, folder in MAPPED.items():
        for source in (ROOT / folder).rglob("*.py"):
            target = tree / installed / source.relative_to(ROOT / folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)


def main() -> int:
    link_tree()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            "-p",
            "asyncengine",
        ],
        cwd=TREE,
        capture_output=True,
        text=True,
    )
    out = result.stdout + result.stderr
    for installed, folder in sorted(MAPPED.items(), key=lambda kv: -len(kv[0])):
        if installed != folder:
            out = out.replace(installed + "/", folder + "/")
    print(out, end="")
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
