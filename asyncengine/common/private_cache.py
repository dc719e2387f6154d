"""The engine's cache directory (``$ASYNCENGINE_CACHE``, default ``~/.cache/asyncengine``): compiled
native kernels and converted models, which the server later loads (``dlopen``) or reads as its
own. Whoever can write there can run code as the server, so:

- ``private_dir`` creates each cache directory with mode 0700; an existing one must be a
  directory owned by this user (else ``UnsafeCacheError``) and loses any group/world write bit.
- ``check_private_file`` (and ``check_private_tree`` for a directory of files) is called before
  a cached file is loaded: owned by this user, a regular file, not group or world writable.
- Built files are written into a temporary name inside the private directory with mode
  0600/0700 and renamed into place, so no one ever sees a half-written entry.
- Each generation of a keyed entry (a new source, flags or library version) leaves the old one
  behind: a use marks its file (``mark_in_use``), and writing a new one sweeps the files of its
  directory no use has marked for ``STALE_AFTER_S`` (``sweep_stale``).
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "ASYNCENGINE_CACHE"
DIR_MODE = 0o700
FILE_MODE = 0o600
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
# a cached file no process has used for this long is an old generation's (an upgrade's): the
# next file written beside it deletes it
STALE_AFTER_S = 30 * 86400


class UnsafeCacheError(PermissionError):
    """A cache path another user could have written: refused before anything is loaded."""


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "asyncengine"


def _owner_problem(info: os.stat_result) -> str | None:
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not this user (uid {os.getuid()})"
    return None


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can write: created 0700 (its missing parents too,
    with the default mode), or an existing one of ours tightened to 0700."""
    try:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    info = os.stat(path)  # a symlink to a directory of ours is fine: its target is checked
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"cache directory {path} is not a directory")
    problem = _owner_problem(info)
    if problem is not None:
        raise UnsafeCacheError(
            f"cache directory {path} is refused: {problem}; point {CACHE_ENV} at a directory "
            "of your own"
        )
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def check_private_file(path: Path) -> None:
    """Raise ``UnsafeCacheError`` unless ``path`` is a regular file of this user that no one
    else may write (what is loaded from the cache must be what this user built)."""
    info = os.lstat(path)
    what = None
    if not stat.S_ISREG(info.st_mode):
        what = "it is not a regular file (a link or a special file)"
    else:
        what = _owner_problem(info)
        if what is None and info.st_mode & _WRITABLE_BY_OTHERS:
            what = f"it is group or world writable (mode {stat.S_IMODE(info.st_mode):o})"
    if what is not None:
        raise UnsafeCacheError(
            f"cached file {path} is refused: {what}; delete it (it is rebuilt on the next start) "
            f"and keep {CACHE_ENV} private to this user"
        )


def check_private_tree(directory: Path) -> None:
    """``check_private_file`` for every file under ``directory``, and the same owner and mode
    rule for the directories themselves."""
    for root, dirs, files in os.walk(directory):
        info = os.lstat(root)
        if _owner_problem(info) is not None or info.st_mode & _WRITABLE_BY_OTHERS:
            raise UnsafeCacheError(
                f"cache directory {root} is refused: it is not this user's alone "
                f"(uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); delete it to rebuild"
            )
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                check_private_file(Path(root, name))  # refused: a link
        for name in files:
            check_private_file(Path(root, name))


def make_private(directory: Path) -> None:
    """Files under a freshly built ``directory`` 0600 and directories 0700 (before it is renamed
    into the cache)."""
    for root, _, files in os.walk(directory):
        os.chmod(root, DIR_MODE)
        for name in files:
            os.chmod(os.path.join(root, name), FILE_MODE)


def write_private_file(path: Path, data: bytes) -> None:
    """``data`` as ``path`` (mode 0600), written under a temporary name beside it and renamed
    into place: a reader, in this process or another, sees the old file or the whole new one."""
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def cache_dir(name: str | None = None) -> Path:
    """The cache root (or its subdirectory ``name``), private to this user (``private_dir``)."""
    root = private_dir(cache_root())
    return root if name is None else private_dir(root / name)


def inside_cache(path: Path) -> bool:
    """Whether ``path`` lies in the cache directory (then it is checked before it is read)."""
    try:
        path.resolve().relative_to(cache_root().resolve())
    except ValueError:
        return False
    return True


def mark_in_use(path: Path) -> None:
    """Set ``path``'s modification time to now (the link itself, never its target), so that no
    sweep deletes it as stale; a file gone meanwhile is left gone."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass


def sweep_stale(
    directory: Path, patterns: Sequence[str], older_than: float = STALE_AFTER_S
) -> list[Path]:
    """Delete the files in ``directory`` (not below it) matching any of ``patterns`` that no
    ``mark_in_use`` has touched for ``older_than`` seconds; answers those deleted. A process
    that has one open or mapped keeps it; one deleted by another sweep meanwhile, a directory
    or a file not ours to delete is skipped."""
    cutoff = time.time() - older_than
    deleted: list[Path] = []
    for pattern in patterns:
        for path in directory.glob(pattern):
            try:
                if path.lstat().st_mtime < cutoff:
                    path.unlink()
                    deleted.append(path)
            except OSError:
                pass
    return deleted
