#!/usr/bin/env python
"""Compile the scheduler, the KV cache and the simulator's step loop with mypyc (the modules
listed in ``asyncengine/compiled.py``): C extensions beside the ``.py`` files, which Python
imports first. ``make setup`` runs it with ``--if-stale``; any edit of a listed module (or of
this script) since the last build makes it build again.

    python scripts/build_native.py              build (about a minute on 2 cores)
    python scripts/build_native.py --if-stale   build only when a source changed since the build
    python scripts/build_native.py --clean      remove the extensions: everything interpreted

mypy follows the imports of the listed modules through the installed layout (the symlink tree of
scripts/typecheck.py, under build/native/); the third-party packages they never use are skipped,
and only the listed modules need to be free of type errors for this (lint checks them all).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from typecheck import link_tree  # noqa: E402

from asyncengine.compiled import (  # noqa: E402
    BUILD_RECORD,
    COMPILED_MODULES,
    PACKAGE,
    build_record,
    extension_path,
    source_hash,
    source_path,
)

WORK = ROOT / "build" / "native"
GROUP = "asyncengine.compiled"  # the shared library: asyncengine/compiled__mypyc.*.so
# imported somewhere in the package, never by the compiled modules: not worth mypy's time
SKIPPED = (
    "torch transformers triton tokenizers safetensors gguf xgrammar aiohttp ray zmq msgspec "
    "jinja2 scipy matplotlib uvloop prometheus_client openai tqdm huggingface_hub"
).split()


def extensions() -> list[Path]:
    """The compiled extensions in the package (all of them this script's)."""
    return sorted(PACKAGE.rglob("*.so"))


def builder_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def mypy_version() -> str:
    from mypy.version import __version__

    return __version__


def up_to_date() -> bool:
    record = build_record()
    if record is None or set(record) != set(COMPILED_MODULES):
        return False
    saved = json.loads(BUILD_RECORD.read_text())
    if saved.get("builder") != builder_hash() or saved.get("mypy") != mypy_version():
        return False
    return all(
        record[name] == source_hash(name) and extension_path(name).exists()
        for name in COMPILED_MODULES
    )


def clean() -> None:
    for path in extensions():
        path.unlink()
    BUILD_RECORD.unlink(missing_ok=True)


def mypy_config() -> Path:
    listed = ",".join(COMPILED_MODULES)
    skipped = ",".join(f"{name}.*" for name in SKIPPED)
    config = WORK / "mypy.ini"
    config.write_text(
        f"[mypy]\nignore_missing_imports = True\n\n"
        f"[mypy-{skipped}]\nfollow_imports = skip\n\n"
        # the modules around the compiled ones are read for their types only
        f"[mypy-asyncengine.*]\nignore_errors = True\n\n"
        f"[mypy-{listed}]\nignore_errors = False\n"
    )
    return config


def build() -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    hashes = {name: source_hash(name) for name in COMPILED_MODULES}  # what is compiled
    tree = WORK / "tree"
    link_tree(tree)
    config = mypy_config()
    sources = [str(source_path(name).relative_to(ROOT)) for name in COMPILED_MODULES]
    cwd = Path.cwd()
    os.chdir(tree)
    try:
        ext_modules = mypycify(
            ["--config-file", str(config), *sources], group_name=GROUP, opt_level="3"
        )
        setup(
            name="asyncengine-compiled",
            ext_modules=ext_modules,
            script_args=[
                "--quiet",
                "build_ext",
                "--inplace",
                "--build-temp",
                str(WORK / "temp"),
                "--parallel",
                str(os.cpu_count() or 1),
            ],
        )
    finally:
        os.chdir(cwd)
    clean()
    for built in sorted((tree / "asyncengine").rglob("*.so")):
        target = PACKAGE / built.relative_to(tree / "asyncengine")
        partial = target.with_name(target.name + ".part")
        partial.write_bytes(built.read_bytes())
        os.replace(partial, target)  # a running process keeps the file it mapped
    record = {"mypy": mypy_version(), "builder": builder_hash(), "sources": hashes}
    BUILD_RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--if-stale", action="store_true", help="build only when out of date")
    parser.add_argument("--clean", action="store_true", help="remove the compiled extensions")
    args = parser.parse_args()
    if args.clean:
        clean()
        print("compiled extensions removed: the package runs interpreted")
        return 0
    if args.if_stale and up_to_date():
        return 0
    print(f"compiling {len(COMPILED_MODULES)} modules with mypyc (scripts/build_native.py) ...")
    start = time.monotonic()
    WORK.mkdir(parents=True, exist_ok=True)
    build()
    print(f"compiled in {time.monotonic() - start:.0f} s: {len(extensions())} extensions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
