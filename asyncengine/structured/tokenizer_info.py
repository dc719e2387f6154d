"""xgrammar's view of a tokenizer (its ``TokenizerInfo``), built once per tokenizer rather than
once per process or engine.

    info = tokenizer_info(tokenizer.backend, vocab_size, stop_token_ids)
    info.xgrammar     # the xgrammar.TokenizerInfo grammars are compiled for
    info.serialized   # its JSON, which the compile worker processes start from

``TokenizerInfo.from_huggingface`` decodes the whole vocabulary (a quarter of a second for 49k
tokens, half a second for 152k, more on a busy host); reading its serialized form back takes a
tenth of that. So the info is kept in process memory (engines in one process share it) and on
disk, in ``$ASYNCENGINE_CACHE/tokenizer-info/``, under a key of everything it is made from: the
tokenizer's content (its JSON, not its path), the width of the logits, the stop tokens and the
versions of the libraries that build it. A cache file that cannot be read, does not
deserialize, does not match its key or is not private to this user (common/private_cache.py)
is rebuilt and replaced; files are written whole under a temporary name and renamed into
place, so processes starting together never read half of one. Each read marks its file in use,
and each file written deletes those no process has read for 30 days (a tokenizer or library
version since replaced; ``sweep_stale``), left-over temporary files with them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncengine.common.private_cache import (
    cache_dir,
    check_private_file,
    mark_in_use,
    sweep_stale,
    write_private_file,
)

log = logging.getLogger("asyncengine.structured")

CACHE_DIR = "tokenizer-info"  # under the engine's cache directory
MEMORY_ENTRIES = 4  # tokenizers kept in process memory (a few MB each)
# what from_huggingface's output depends on besides its arguments
LIBRARIES = ("xgrammar", "transformers", "tokenizers")
# the infos and write_private_file's staging files (".<name>.<random>")
SWEPT = ("*.json", ".*.json.*")


@dataclass(frozen=True, slots=True)
class TokenizerInfoKey:
    """Everything a TokenizerInfo is made from."""

    tokenizer_sha256: str  # of the tokenizer's serialized JSON
    vocab_size: int
    stop_token_ids: tuple[int, ...]  # () lets xgrammar find them in the tokenizer
    library_versions: tuple[str, ...]

    def digest(self) -> str:
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()


@dataclass(frozen=True, slots=True, eq=False)
class BuiltTokenizerInfo:
    xgrammar: Any  # xgrammar.TokenizerInfo
    serialized: bytes  # its serialize_json()


@functools.cache
def _library_versions() -> tuple[str, ...]:
    return tuple(f"{name} {importlib.metadata.version(name)}" for name in LIBRARIES)


def tokenizer_info_key(
    backend: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> TokenizerInfoKey:
    """The key of the info of ``backend`` (a ``tokenizers.Tokenizer``)."""
    content = hashlib.sha256(backend.to_str().encode()).hexdigest()
    return TokenizerInfoKey(content, vocab_size, tuple(stop_token_ids), _library_versions())


_memory: OrderedDict[str, BuiltTokenizerInfo] = OrderedDict()
_memory_lock = threading.Lock()  # one build at a time: concurrent engines wait for it


def tokenizer_info(
    backend: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> BuiltTokenizerInfo:
    """The info of ``backend`` for logits ``vocab_size`` wide: from memory, else from the disk
    cache, else built (and written there)."""
    key = tokenizer_info_key(backend, vocab_size, stop_token_ids)
    digest = key.digest()
    with _memory_lock:
        built = _memory.get(digest)
        if built is None:
            built = _from_disk_or_built(backend, key)
            _memory[digest] = built
        _memory.move_to_end(digest)
        while len(_memory) > MEMORY_ENTRIES:
            _memory.popitem(last=False)
        return built


def forget_in_memory() -> None:
    """Empty the process's copy (the disk cache stays): the next call reads the disk."""
    with _memory_lock:
        _memory.clear()


def cache_file(key: TokenizerInfoKey) -> Path:
    """Where ``key``'s info is cached on disk (the directory made private to this user)."""
    return cache_dir(CACHE_DIR) / f"{key.digest()[:32]}.json"


def _from_disk_or_built(backend: Any, key: TokenizerInfoKey) -> BuiltTokenizerInfo:
    import xgrammar

    try:
        path: Path | None = cache_file(key)
    except OSError as error:  # an unusable cache directory costs this process the build only
        log.warning("tokenizer info not cached: %s", error)
        path = None
    if path is not None and (loaded := _load(xgrammar, path, key)) is not None:
        return loaded
    built = _build(xgrammar, backend, key)
    if path is not None:
        try:
            write_private_file(path, built.serialized)
        except OSError as error:
            log.warning("tokenizer info not cached at %s: %s", path, error)
        else:
            sweep_stale(path.parent, SWEPT)
    return built


def _load(xgrammar: Any, path: Path, key: TokenizerInfoKey) -> BuiltTokenizerInfo | None:
    """``path``'s info, or None when there is none to trust (then it is rebuilt)."""
    try:
        check_private_file(path)  # what another user could have written is never read
        serialized = path.read_bytes()
        info = xgrammar.TokenizerInfo.deserialize_json(serialized.decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RuntimeError) as error:  # xgrammar's errors are RuntimeErrors
        log.warning("tokenizer info cache %s refused, rebuilding it: %s", path, error)
        return None
    stop_ids = set(info.stop_token_ids)  # xgrammar keeps them sorted
    if info.vocab_size != key.vocab_size or (
        key.stop_token_ids and stop_ids != set(key.stop_token_ids)
    ):
        log.warning("tokenizer info cache %s does not match its key, rebuilding it", path)
        return None
    mark_in_use(path)  # no sweep deletes it as stale
    return BuiltTokenizerInfo(info, serialized)


def _build(xgrammar: Any, backend: Any, key: TokenizerInfoKey) -> BuiltTokenizerInfo:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend)
    info = xgrammar.TokenizerInfo.from_huggingface(
        wrapped, vocab_size=key.vocab_size, stop_token_ids=list(key.stop_token_ids) or None
    )
    return BuiltTokenizerInfo(info, info.serialize_json().encode())
