"""A GGUF file's metadata and tensors, read in one pass over its header, its tensors memory-mapped.

``gguf.GGUFReader`` builds a numpy view for every part of every field: seconds for a vocabulary
of 50k-150k tokens and as many merges, most of a small model's start-up. Here the header is
parsed with ``struct`` (strings decoded once, the long arrays of them - a vocabulary, its merges -
when first read; numeric arrays as one ``frombuffer`` each) and the
tensors are plain ndarray views of one copy-on-write ``mmap`` of the file: nothing is copied until a
consumer copies it, and the pages are read when touched. Values and tensor views are those
``GGUFReader`` gives (``field.contents()``; ``tensor.data`` typed and shaped as it shapes them).

Once the weights are packed into memory of their own, the map's pages are dropped from this
process (``drop_file_pages``): they stay in the OS's page cache, and a view still in use (an untied
embedding's looked-up rows, a float32 norm) reads its pages back when touched. Without it a
model held its file twice (the map's pages read while packing, and the packed copy).
"""

from __future__ import annotations

import mmap
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from asyncengine.executor.loader.hf_dir import ModelFilesError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: the struct code of each scalar (8: string, 9: array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9
LAZY_STRINGS = 4096  # string arrays at least this long are decoded when first read
_LENGTH = struct.Struct("<Q")  # a string's length before its bytes
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
# every open GGUF map: (first address, end address, the map), so a tensor's pages can be dropped
# knowing only its address; weak, so a map no view uses still closes
_MAPS: list[tuple[int, int, weakref.ref[mmap.mmap]]] = []
_MAPS_LOCK = threading.Lock()
# element types of the tensors GGUFReader returns typed (every other type: its bytes)
_TYPED = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    n_elements: int
    n_bytes: int
    data: np.ndarray  # a view of the file's map


@dataclass(frozen=True, slots=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)


class StringArray(Sequence[str]):
    """A long string array of the header (a vocabulary, its merges), decoded the first time an
    item is read: a start whose tokenizer files are cached reads only its length. Equal to the
    list of its strings."""

    def __init__(self, cursor: _Cursor, start: int, count: int) -> None:
        self._cursor, self._start, self._count = cursor, start, count
        self._strings: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._strings is None:
            self._cursor.at = self._start
            self._strings = self._cursor.strings(self._count)
        return self._strings

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            other = other._decoded()
        return isinstance(other, list) and self._decoded() == other

    __hash__ = None  # type: ignore[assignment]  # a list's equal is unhashable

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class _Cursor:
    def __init__(self, buffer: memoryview | bytes) -> None:
        self.buffer = buffer
        self.at = 0

    def unpack(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        start = self.at
        self.at += length
        return bytes(self.buffer[start : self.at]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary: 50k-250k of them), in one tight loop."""
        buffer, at, length_at = self.buffer, self.at, _LENGTH.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (length,) = length_at(buffer, at)
            at += 8
            append(str(buffer[at : at + length], "utf-8", "replace"))
            at += length
        self.at = at
        return out

    def skip_strings(self, count: int) -> StringArray:
        """``count`` strings in a row, left undecoded: their lengths walked (a fifth of the
        decoding's time: a 128k vocabulary and its merges took 0.4 s to decode, every start)."""
        buffer, start, at, length_at = self.buffer, self.at, self.at, _LENGTH.unpack_from
        for _ in range(count):
            at += 8 + length_at(buffer, at)[0]
        self.at = at
        return StringArray(_Cursor(buffer), start, count)

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item == _STRING:
                if count >= LAZY_STRINGS:
                    return self.skip_strings(count)
                return self.strings(count)
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                array = np.frombuffer(self.buffer, dtype, count, self.at)
                self.at += dtype.itemsize * count
                return array.tolist()
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        raise ModelFilesError(f"GGUF value of unknown type {kind}")


def read_gguf_file(path: str | Path) -> GGUFFile:
    """The file's metadata (key -> value) and tensors (views of its memory map)."""
    with open(path, "rb") as f:
        # copy-on-write: the views are writable (torch takes them without a copy or a warning)
        # and a write, should any consumer make one, changes this process's pages, not the file
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buffer = memoryview(mapped)
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != MAGIC:
        raise ModelFilesError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.unpack("I")
    if version not in (2, 3):
        raise ModelFilesError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = cursor.unpack("Q"), cursor.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.unpack("I")), cursor.unpack("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.at // alignment) * alignment
    # one ndarray over the map: slicing it gives plain views (np.memmap slices are slow)
    whole = np.frombuffer(buffer, dtype=np.uint8)
    _register(mapped, int(whole.ctypes.data), whole.size)
    # the header is parsed into Python values (a vocabulary and its merges: megabytes)
    drop_file_pages(int(whole.ctypes.data), data_start)
    tensors = []
    for name, dims, kind, offset in infos:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * block_bytes // block
        start = data_start + offset
        if start + n_bytes > whole.size:
            raise ModelFilesError(f"{path}: tensor {name} runs past the end of the file")
        raw = whole[start : start + n_bytes]
        shape = tuple(reversed(dims))
        if kind in _TYPED:
            data = raw.view(_TYPED[kind]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, dims, n_elements, n_bytes, data))
    return GGUFFile(metadata, tensors)


def _register(mapped: mmap.mmap, start: int, size: int) -> None:
    with _MAPS_LOCK:
        _MAPS[:] = [entry for entry in _MAPS if entry[2]() is not None]
        _MAPS.append((start, start + size, weakref.ref(mapped)))


def drop_file_pages(address: int, nbytes: int) -> int:
    """Drop this process's pages of [address, address + nbytes) where that range lies in an
    open GGUF map (whole pages inside it only; other memory is left alone); the bytes dropped.

    The map is private and never written, so its pages read back from the file as they were.
    """
    if _MADV_DONTNEED is None or nbytes <= 0:
        return 0
    with _MAPS_LOCK:
        for lo, hi, ref in _MAPS:
            mapped = ref()
            if mapped is None or not lo <= address < hi:
                continue
            first = -(-(address - lo) // mmap.PAGESIZE) * mmap.PAGESIZE
            end = min(address + nbytes, hi) - lo
            end -= end % mmap.PAGESIZE if end < hi - lo else 0
            if end <= first:
                return 0
            try:
                mapped.madvise(_MADV_DONTNEED, first, end - first)
            except (OSError, ValueError):  # closed meanwhile, or an OS without it
                return 0
            return end - first
    return 0


def drop_tensor_pages(tensor: torch.Tensor) -> int:
    """``drop_file_pages`` over the storage under ``tensor`` (a view of a GGUF map, or not)."""
    storage = tensor.untyped_storage()
    return drop_file_pages(storage.data_ptr(), storage.nbytes())


def drop_all_file_pages() -> int:
    """``drop_file_pages`` over every open GGUF map, whole; the bytes dropped."""
    with _MAPS_LOCK:
        spans = [(lo, hi - lo) for lo, hi, ref in _MAPS if ref() is not None]
    return sum(drop_file_pages(lo, size) for lo, size in spans)
