"""keep_freed_memory: blocks a step frees come back without page faults; give_back_freed_memory:
what it kept goes back to the OS (glibc only)."""

from __future__ import annotations

import ctypes
import json
import resource
import threading

import pytest

from asyncengine.executor.cpu import malloc_reuse
from tests.python_subprocess import run_python

LIBC = ctypes.CDLL(None)
GLIBC = hasattr(LIBC, "gnu_get_libc_version")
BLOCK_BYTES = 16 << 20  # below the fixed mmap threshold, above glibc's default one
BLOCKS = 12  # 192 MiB: past glibc's default trim threshold and more than one thread heap
PAGES = BLOCKS * BLOCK_BYTES // 4096


def faults_per_round(rounds: int = 3) -> list[int]:
    """Minor page faults of each round of allocating, writing and freeing ``BLOCKS`` blocks, on a
    thread of its own (the engine's forward runs on one: its own malloc arena)."""
    malloc, free, memset = LIBC.malloc, LIBC.free, LIBC.memset
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    counted: list[int] = []

    def run() -> None:
        for round_ in range(rounds):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            blocks = [malloc(BLOCK_BYTES) for _ in range(BLOCKS)]
            assert all(blocks)
            for block in blocks:
                memset(block, round_ + 1, BLOCK_BYTES)
            for block in blocks:
                free(block)
            counted.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return counted


# in a fresh interpreter: the suite's process has set the thresholds and holds freed heap already
FAULTS = """
import json
from asyncengine.executor.cpu import malloc_reuse
from tests.python_subprocess import run_python
from tests.executor.test_malloc_reuse import faults_per_round
assert malloc_reuse.keep_freed_memory()
print(json.dumps(faults_per_round()))
"""


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's (mallopt)")
def test_freed_blocks_come_back_without_faults() -> None:
    first, *later = json.loads(run_python(FAULTS).strip().splitlines()[-1])
    # the first round faults its pages in (glibc's defaults: every round does, or ~3/4 of them)
    assert first >= PAGES
    assert max(later) < PAGES // 100


def anon_mib() -> int:
    """This process's anonymous resident memory, MiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) // 1024


GIVE_BACK = """
import json
from asyncengine.executor.cpu import malloc_reuse
from tests.executor.test_malloc_reuse import anon_mib, faults_per_round
assert malloc_reuse.keep_freed_memory()
before = anon_mib()
faults_per_round(rounds=1)
kept = anon_mib()
assert malloc_reuse.give_back_freed_memory()
print(json.dumps([before, kept, anon_mib()]))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_kept_memory_goes_back_to_the_os() -> None:
    before, kept, after = json.loads(run_python(GIVE_BACK).strip().splitlines()[-1])
    written = BLOCKS * BLOCK_BYTES >> 20
    assert kept - before >= written * 3 // 4  # freed, but kept mapped for the next step
    # back to the OS but for the top of the last thread heap (glibc trims only the main heap's)
    assert kept - after >= (kept - before) // 2


def test_without_glibc_nothing_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another C library (no ``gnu_get_libc_version``): the call says it did nothing."""
    monkeypatch.setattr(malloc_reuse.ctypes, "CDLL", lambda name: object())
    assert malloc_reuse.give_back_freed_memory() is False


def test_switch_off_leaves_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(malloc_reuse.ENABLE_ENV, "0")
    assert not malloc_reuse.keep_freed_memory()
