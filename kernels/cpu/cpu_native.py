"""Native CPU kernels (kernels/cpu/*.c), compiled on first use and loaded with ctypes.

Each C file is compiled once per machine with the system C compiler (``cc -O3 -march=native
-fopenmp``) into ``$ASYNCENGINE_CACHE/kernels/`` (default ``~/.cache/asyncengine``), named by
the hash of its source, the flags and this CPU's model, so later starts only load it (a second
at most the first time, nothing after); a compile deletes the libraries no process has loaded
for ``STALE_AFTER_S`` (30 days: an upgrade's old generation; ``sweep_stale`` in
asyncengine/common/private_cache.py). The directory is private to this
user (0700) and a library is loaded only if it is this user's and no one else may write it
(asyncengine/common/private_cache.py): else ``UnsafeCacheError`` names the file and what is wrong. ctypes releases the GIL while a kernel runs, and the
library shares torch's OpenMP runtime (torch loads ``libgomp.so.1`` first, and the dynamic
loader reuses it by that name), so its parallel loops run on torch's threads.

Where no compiler works (or ``ASYNCENGINE_NATIVE_KERNELS=0``), ``load`` returns None and the
callers keep their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from asyncengine.common.private_cache import (
    DIR_MODE,
    cache_dir,
    cache_root,
    check_private_file,
    mark_in_use,
    sweep_stale,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("asyncengine.kernels")

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ENABLE_ENV = "ASYNCENGINE_NATIVE_KERNELS"
KERNEL_DIR = "kernels"
# the libraries and the compiler's left-over staging files (each change of a source or of the
# flags, an upgrade, leaves a generation behind: a compile sweeps those unused for 30 days)
SWEPT = ("*.so",)


def _cache_dir() -> Path:
    return cache_root() / KERNEL_DIR


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def compiler_found() -> bool:
    """Whether a C compiler is here (without one the native kernels cannot be built)."""
    return _compiler() is not None


def library_path(name: str, extra_flags: tuple[str, ...] = ()) -> Path:
    source = (SOURCE_DIR / f"{name}.c").read_bytes()
    headers = b"".join(p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.h")))
    flags = " ".join([*FLAGS, *extra_flags])
    key = hashlib.sha256(source + headers + flags.encode() + _cpu_model().encode()).hexdigest()
    return _cache_dir() / f"{name}-{key[:16]}.so"


@functools.cache
def load(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library of kernels/<name>.c, built on first use; None when unavailable.
    ``extra_flags`` (e.g. ``("-DQ_FORCE_AVX2",)``) build a variant beside the default one."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    import torch  # noqa: F401  (its libgomp must be loaded first: the library shares it)

    cache_dir(KERNEL_DIR)  # 0700, ours (else UnsafeCacheError)
    target = library_path(name, extra_flags)
    mark_in_use(target)  # before anything else, so that no compile deletes it as stale meanwhile
    if not os.path.lexists(target):
        compiler = _compiler()
        if compiler is None:
            log.warning("no C compiler found: native CPU kernels are off (torch paths instead)")
            return None
        fd, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [
            compiler,
            *FLAGS,
            *extra_flags,
            str(SOURCE_DIR / f"{name}.c"),
            "-o",
            staging,
            "-lm",
        ]
        log.info("compiling the native CPU kernel %s for this CPU (once; cached)", name)
        started = time.perf_counter()
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
            os.chmod(staging, DIR_MODE)  # the linker may have made it anew with the umask's mode
            os.replace(staging, target)  # atomic: concurrent first starts see a whole file
            log.info("compiled %s in %.1fs: %s", name, time.perf_counter() - started, target)
            sweep_stale(target.parent, SWEPT)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning(
                "native CPU kernel %s did not compile (%s); torch paths instead",
                name,
                detail[-500:],
            )
            Path(staging).unlink(missing_ok=True)
            return None
    check_private_file(target)  # never dlopen what another user could have written
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        log.warning("native CPU kernel %s did not load (%s); torch paths instead", name, exc)
        return None


# The libraries that read or write the K/V pool (they include cpu_kv.h): built once more with
# -DKV_F16 for a float16 pool (``kv_flags``), which they then read through F16C.
KV_LIBRARIES = ("cpu_decode_attention", "cpu_extend_attention", "cpu_decode_step", "cpu_layer_ops")
_KV_F16_FLAGS = ("-DKV_F16",)
_KV_I8_FLAGS = ("-DKV_I8",)
# asyncengine_kv_element of an int8 build: 1 byte + 64
KV_I8_ELEMENT = 65


def kv_flags(kv_dtype: torch.dtype) -> tuple[str, ...]:
    """The extra build flags of a KV library for a pool of ``kv_dtype``: float16 and int8 have
    builds of their own; float32 and bfloat16 pools share the default one (a flag says which at
    each call)."""
    import torch

    if kv_dtype == torch.float16:
        return _KV_F16_FLAGS
    return _KV_I8_FLAGS if kv_dtype == torch.int8 else ()


def kv_i8_native() -> bool:
    """Whether every KV library builds for an int8 pool here (``asyncengine_kv_element``)."""
    for name in KV_LIBRARIES:
        lib = load(name, _KV_I8_FLAGS)
        if lib is None or lib.asyncengine_kv_element() != KV_I8_ELEMENT:
            return False
    return True


def kv_i8_query_dots(head_dim: int) -> bool:
    """Whether the int8 decode attention (the fused step's and the paged kernel's streamed path)
    takes the query rounded to int8 for heads of ``head_dim`` (AVX-512 VNNI builds,
    cpu_stream_i8_dots.h; kv_int8_ref.quantize_query is its twin)."""
    lib = load("cpu_decode_attention", _KV_I8_FLAGS)
    return lib is not None and bool(lib.asyncengine_kv_i8_query_dots()) and head_dim % 64 == 0


def kv_f16_native() -> bool:
    """Whether every KV library builds for a float16 pool here and reads it through F16C
    (``asyncengine_kv_element``: 2 bytes + 16 for F16C)."""
    for name in KV_LIBRARIES:
        lib = load(name, _KV_F16_FLAGS)
        if lib is None or lib.asyncengine_kv_element() != 18:
            return False
    return True


def load_all(kv_extra_flags: tuple[str, ...] = ()) -> int:
    """Compile (where not cached) and load every kernel library, so that no request waits for
    gcc: the engine calls it at start-up on a CPU, with its pool's ``kv_flags`` (the KV
    libraries are also built with those). Returns how many loaded."""
    builds: list[tuple[str, tuple[str, ...]]] = [
        (path.stem, ()) for path in sorted(SOURCE_DIR.glob("*.c"))
    ]
    if kv_extra_flags:
        builds += [(name, kv_extra_flags) for name in KV_LIBRARIES]
    # one compiler per core at once: a first start compiles ~15 libraries (~45 s one at a time
    # on two cores)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(max_workers=max(1, cores or 1)) as pool:
        libraries = list(pool.map(lambda build: load(*build), builds))
    return sum(lib is not None for lib in libraries)
