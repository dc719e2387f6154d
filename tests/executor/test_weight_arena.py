"""The quantized weights written into one huge-page buffer (executor/cpu/weight_arena.py): the
same bytes and the same products, every part a view of one buffer that starts on a huge page,
and the switch that turns it off."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from asyncengine.executor.cpu import weight_arena
from asyncengine.executor.cpu.weight_pack import write_pending
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.quant_formats import FORMATS, QuantizedTensor
from tests.kernels.test_quantized_kernels import random_weight
from tests.native_support import needs_native

pytestmark = needs_native


def _parts() -> list[list[QuantizedTensor]]:
    q4 = FORMATS["Q4_1"]
    return [
        [random_weight(q4, 40, 96, seed=1), random_weight(FORMATS["Q8_0"], 9, 96, seed=2)],
        [random_weight(q4, 17, 64, seed=3)],
    ]


def test_parts_are_written_into_one_aligned_buffer_with_their_bytes_and_products() -> None:
    parts = _parts()
    bias = torch.randn(17)
    alone = [QuantizedLinear(parts[0]), QuantizedLinear(parts[1], bias=bias)]
    arena = weight_arena.arena_for([p for run in parts for p in run])
    assert arena is not None and arena.buffer.data_ptr() % weight_arena.HUGE_PAGE == 0
    linears = [QuantizedLinear(parts[0], arena=arena), QuantizedLinear(parts[1], bias, arena=arena)]
    write_pending(arena)
    end = arena.buffer.data_ptr() + arena.buffer.numel()
    previous = arena.buffer.data_ptr()
    for linear, own in zip(linears, alone, strict=True):
        for part, data in zip(linear.parts, own.parts, strict=True):
            assert torch.equal(part.data, data.data)
            start = part.data.data_ptr()  # in the buffer, in order, on a cache line
            assert previous <= start and start + part.nbytes <= end
            assert start % weight_arena.ALIGN == 0
            previous = start + part.nbytes
    for linear, own in zip(linears, alone, strict=True):
        x = torch.randn(3, linear.in_features)
        assert torch.equal(linear(x), own(x))


def test_a_part_past_the_end_gets_its_own_tensor() -> None:
    arena = weight_arena.WeightArena(100)
    inside = arena.take(2, 40)
    outside = arena.take(1, 40)  # 80 + 40 > 100
    assert inside.data_ptr() == arena.buffer.data_ptr() and inside.shape == (2, 40)
    start, stop = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.buffer.numel()
    assert outside.shape == (1, 40) and not start <= outside.data_ptr() < stop


def test_switched_off_there_is_no_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_arena.ENABLE_ENV, "0")
    assert weight_arena.arena_for(_parts()[0]) is None


def test_nothing_to_hold() -> None:
    assert weight_arena.arena_for([]) is None
    assert weight_arena.arena_for([torch.ones(8)]) is None  # norms are not held there


def mapping_fields(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields of the mapping holding address (name -> values)."""
    fields: dict[str, list[str]] = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head, *rest = line.split()
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low <= address < high
        elif inside:
            fields[head.rstrip(":")] = rest
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_the_buffer_is_private_memory_advised_to_use_huge_pages() -> None:
    buffer = weight_arena.hugepage_buffer(3 << 20)
    buffer.fill_(1)
    for address in (buffer.data_ptr(), buffer.data_ptr() + buffer.numel() - 1):
        fields = mapping_fields(address)
        assert "hg" in fields["VmFlags"]  # madvise(MADV_HUGEPAGE) took
        # anonymous, not shmem (a shared mapping's huge pages follow another setting)
        assert int(fields["Anonymous"][0]) > 0


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


def collapse_runs_here() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    if not sys.platform.startswith("linux") or not _kernel_at_least(6, 1):
        return False
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.exists() and "[never]" not in setting.read_text()


needs_collapse = pytest.mark.skipif(
    not collapse_runs_here(), reason="MADV_COLLAPSE: Linux 6.1+, huge pages not off"
)


@needs_collapse
def test_deferred_huge_pages_come_after_the_write_with_the_same_bytes() -> None:
    """Written in plain pages (no advice, no huge page), then moved a few MiB per step: the
    same bytes at the same address, in huge pages once the steps say they are done."""
    parts = [random_weight(FORMATS["Q8_0"], 4096, 2048, seed=7)]  # 8.5 MiB: three steps
    arena = weight_arena.arena_for(parts, defer_huge_pages=True)
    assert arena is not None
    linear = QuantizedLinear(parts, arena=arena)
    write_pending(arena)
    start = arena.buffer.data_ptr()
    assert "hg" not in mapping_fields(start)["VmFlags"]
    assert int(mapping_fields(start)["AnonHugePages"][0]) == 0
    before = linear.parts[0].data.clone()
    x = torch.randn(2, 2048)
    expected = linear(x)
    steps = 1
    while arena.huge_pages_step():
        steps += 1
        assert steps < 100
    assert steps == -(-arena.used // weight_arena.COLLAPSE_BYTES)
    assert not arena.huge_pages_deferred and not arena.huge_pages_step()
    fields = mapping_fields(start)
    assert "hg" in fields["VmFlags"]
    assert int(fields["AnonHugePages"][0]) * 1024 >= arena.used - weight_arena.HUGE_PAGE
    assert linear.parts[0].data.data_ptr() == start
    assert torch.equal(linear.parts[0].data, before) and torch.equal(linear(x), expected)


def test_an_arena_advised_at_once_has_nothing_deferred() -> None:
    arena = weight_arena.arena_for(_parts()[0])
    assert arena is not None and not arena.huge_pages_deferred and not arena.huge_pages_step()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_without_collapse_the_deferred_pages_are_left_to_khugepaged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where madvise has no MADV_COLLAPSE the first step advises huge pages over the written
    bytes (khugepaged's to move) and ends the work; the bytes stay as written."""
    monkeypatch.setattr(weight_arena, "MADV_COLLAPSE", None)
    parts = [random_weight(FORMATS["Q8_0"], 64, 256, seed=8)]
    arena = weight_arena.arena_for(parts, defer_huge_pages=True)
    assert arena is not None
    linear = QuantizedLinear(parts, arena=arena)
    write_pending(arena)
    before = linear.parts[0].data.clone()
    assert arena.huge_pages_deferred
    assert not arena.huge_pages_step()
    assert not arena.huge_pages_deferred and not arena.huge_pages_step()
    assert "hg" in mapping_fields(arena.buffer.data_ptr())["VmFlags"]
    assert torch.equal(linear.parts[0].data, before)
