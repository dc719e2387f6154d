"""The cache directory (compiled kernels, converted models) cannot be planted: directories 0700,
built files private, and a cached file another user could have written is refused before it is
loaded (asyncengine/common/private_cache.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncengine.common.private_cache import (
    STALE_AFTER_S,
    cache_dir,
    check_private_file,
    mark_in_use,
    private_dir,
    sweep_stale,
)
from asyncengine.executor.loader import CACHE_ENV, UnsafeCacheError
from asyncengine.executor.loader import default_model as default_model_module
from asyncengine.executor.loader.default_model import (
    gguf_file,
    metadata_dir,
    resolve_model,
    tokenizer_dir,
)
from asyncengine.kernels.cpu import cpu_native

KERNEL = "cpu_layer_ops"
# a library whose constructor leaves a marker: loading it is running the planter's code
PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    cpu_native.load.cache_clear()
    yield root
    cpu_native.load.cache_clear()


@contextlib.contextmanager
def _another_user() -> Iterator[None]:
    """Within it, every existing file belongs to someone else (this process's uid changes)."""
    uid = os.getuid()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "getuid", lambda: uid + 1)
        yield


def _plant(target: Path, marker: Path, mode: int) -> None:
    source = target.with_suffix(".c")
    source.write_text(f'#define MARKER "{marker}"\n{PLANTED_C}')
    compiler = cpu_native._compiler()
    assert compiler is not None
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    source.unlink()
    os.chmod(target, mode)


def test_cache_directories_are_created_private(cache: Path) -> None:
    kernels = cache_dir("kernels")
    assert _mode(cache) == 0o700
    assert _mode(kernels) == 0o700


def test_an_open_cache_directory_of_ours_is_tightened(cache: Path) -> None:
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    assert private_dir(cache) == cache
    assert _mode(cache) == 0o700


def test_a_cache_directory_of_another_user_is_refused(cache: Path) -> None:
    cache.mkdir()
    with (
        _another_user(),
        pytest.raises(UnsafeCacheError, match=f"cache directory {cache} is refused: it is owned"),
    ):
        private_dir(cache)


def test_a_cache_path_that_is_not_a_directory_is_refused(cache: Path) -> None:
    cache.write_text("x")
    with pytest.raises(UnsafeCacheError, match="is not a directory"):
        private_dir(cache)


def test_a_built_kernel_is_private_and_loads(cache: Path) -> None:
    assert cpu_native.load(KERNEL) is not None
    built = cpu_native.library_path(KERNEL)
    assert built.parent == cache / "kernels"
    assert _mode(built) == 0o700
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no staging file left


def test_a_compile_deletes_the_libraries_no_process_has_loaded_for_a_month(cache: Path) -> None:
    """Each load marks its library in use; compiling another deletes the libraries (and left-over
    staging files) not marked for ``STALE_AFTER_S``, and nothing else."""
    assert cpu_native.load(KERNEL) is not None
    kernels = cache / "kernels"
    built = cpu_native.library_path(KERNEL)
    month_ago = time.time() - STALE_AFTER_S - 60
    stale = kernels / "cpu_gone-0123456789abcdef.so"
    recent = kernels / "cpu_recent-0123456789abcdef.so"
    not_a_library = kernels / "notes.txt"
    for path in (stale, recent, not_a_library):
        path.write_bytes(b"")
    for path in (stale, not_a_library, built):
        os.utime(path, (month_ago, month_ago))
    cpu_native.load.cache_clear()
    assert cpu_native.load(KERNEL) is not None  # loaded again: in use
    assert built.stat().st_mtime > month_ago + 60
    assert stale.exists()  # loading compiles nothing, so deletes nothing
    assert cpu_native.load(KERNEL, ("-DASYNCENGINE_ANOTHER_BUILD",)) is not None
    assert not stale.exists()
    assert recent.exists() and not_a_library.exists() and built.exists()


def test_a_sweep_deletes_the_matching_files_unused_for_a_month_and_nothing_else(
    tmp_path: Path,
) -> None:
    """One sweeper for every keyed cache: files of ``patterns`` whose last use is older than
    ``STALE_AFTER_S`` go; recent ones, those just marked in use, other names, files below the
    directory and directories stay."""
    month_ago = time.time() - STALE_AFTER_S - 60
    names = ("old.json", ".old.json.x1y2", "used.json", "new.json", "notes.txt", "sub.json")
    paths = {name: tmp_path / name for name in names}
    nested = tmp_path / "deeper" / "old.json"
    nested.parent.mkdir()
    for name, path in [*paths.items(), ("nested", nested)]:
        if name == "sub.json":
            path.mkdir()
        else:
            path.write_bytes(b"{}")
        if name != "new.json":
            os.utime(path, (month_ago, month_ago))
    mark_in_use(paths["used.json"])
    mark_in_use(tmp_path / "gone.json")  # nothing to mark: no error, nothing made
    deleted = sweep_stale(tmp_path, ("*.json", ".*.json.*"))
    assert sorted(p.name for p in deleted) == [".old.json.x1y2", "old.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "deeper", "new.json", "notes.txt", "sub.json", "used.json"
    ]  # fmt: skip
    assert nested.exists() and not (tmp_path / "gone.json").exists()
    assert sweep_stale(tmp_path, ("*.json",), older_than=0.0) != []  # the bound is the caller's


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_planted_writable_kernel_is_refused_before_it_runs(
    cache: Path, tmp_path: Path, mode: int
) -> None:
    target = cpu_native.library_path(KERNEL)
    cache_dir("kernels")
    marker = tmp_path / "marker"
    _plant(target, marker, mode)
    with pytest.raises(UnsafeCacheError, match=rf"{target}.*group or world writable"):
        cpu_native.load(KERNEL)
    assert not marker.exists()


def test_a_kernel_of_another_user_is_refused_before_it_runs(cache: Path, tmp_path: Path) -> None:
    target = cpu_native.library_path(KERNEL)
    cache_dir("kernels")
    marker = tmp_path / "marker"
    _plant(target, marker, 0o755)
    with _another_user():
        # the directories are checked first: refused as someone else's, nothing loaded
        with pytest.raises(UnsafeCacheError, match=f"{cache} is refused: it is owned by uid"):
            cpu_native.load(KERNEL)
        with pytest.raises(UnsafeCacheError, match=f"{target} is refused: it is owned by uid"):
            check_private_file(target)
    assert not marker.exists()


def test_a_kernel_link_is_refused(cache: Path, tmp_path: Path) -> None:
    target = cpu_native.library_path(KERNEL)
    cache_dir("kernels")
    elsewhere = tmp_path / "elsewhere.so"
    _plant(elsewhere, tmp_path / "marker", 0o755)
    target.symlink_to(elsewhere)
    with pytest.raises(UnsafeCacheError, match="not a regular file"):
        cpu_native.load(KERNEL)
    assert not (tmp_path / "marker").exists()


def _gguf() -> Path:
    return default_model_module.KNOWN_MODELS["smollm2-135m"].gguf_path()


def test_converted_entries_are_private_and_a_tampered_one_is_refused(cache: Path) -> None:
    entry = metadata_dir(_gguf(), "smollm2-135m")
    assert _mode(cache) == 0o700
    assert _mode(entry) == 0o700
    files = [p for p in entry.rglob("*") if p.is_file()]
    assert files and all(_mode(p) == 0o600 for p in files)
    assert metadata_dir(_gguf(), "smollm2-135m") == entry  # reused as it is

    tampered = entry / "tokenizer.json"
    os.chmod(tampered, 0o666)
    with pytest.raises(UnsafeCacheError, match=f"{tampered} is refused: it is group or world"):
        metadata_dir(_gguf(), "smollm2-135m")
    os.chmod(tampered, 0o600)
    os.chmod(entry, 0o777)
    with pytest.raises(UnsafeCacheError, match=f"{entry} is refused"):
        metadata_dir(_gguf(), "smollm2-135m")


def test_a_model_directory_inside_the_cache_is_checked(cache: Path) -> None:
    entry = metadata_dir(_gguf(), "smollm2-135m")
    assert resolve_model(entry, torch.float32) == entry
    os.chmod(entry / "config.json", 0o646)
    with pytest.raises(UnsafeCacheError, match="config.json is refused"):
        resolve_model(entry, torch.float32)


def test_entries_of_a_changed_or_deleted_gguf_are_deleted_as_a_new_one_is_built(
    cache: Path, tmp_path: Path
) -> None:
    kept = metadata_dir(_gguf(), "smollm2-135m")  # a known name's entry: never deleted
    first = tmp_path / "first.gguf"
    shutil.copyfile(_gguf(), first)
    old = metadata_dir(*_found(first))
    again = metadata_dir(*_found(first))
    assert again == old and old.is_dir()  # unchanged: reused

    os.utime(first, ns=(time.time_ns(), time.time_ns() + 10**9))  # replaced in place
    new = metadata_dir(*_found(first))
    assert new != old and not old.exists() and new.is_dir()

    second = tmp_path / "second.gguf"
    shutil.copyfile(_gguf(), second)
    converted = tokenizer_dir(second)
    second.unlink()
    first_tokenizer = tokenizer_dir(first)  # a build: deletes what the gone file made
    assert not converted.exists()
    assert new.is_dir() and first_tokenizer.is_dir() and kept.is_dir()
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
        [kept.name, new.name, first_tokenizer.name]
    )


def _found(path: Path) -> tuple[Path, str]:
    found = gguf_file(path)
    assert found is not None
    return found
