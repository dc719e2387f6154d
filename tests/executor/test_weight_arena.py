"""The quantized weights packed into one huge-page buffer (executor/cpu/weight_arena.py): the same
bytes and the same products, every part a view of one buffer that starts on a huge page, and
the switch that turns it off."""

from __future__ import annotations

import sys

import pytest
import torch

from asyncengine.executor.cpu import weight_arena
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.quant_formats import FORMATS
from tests.kernels.test_quantized_kernels import random_weight

pytestmark = pytest.mark.skipif(
    not cpu_native.compiler_found(), reason="no C compiler: the native kernels cannot be built"
)


def _linears() -> list[QuantizedLinear]:
    q4 = FORMATS["Q4_1"]
    return [
        QuantizedLinear(
            [random_weight(q4, 40, 96, seed=1), random_weight(FORMATS["Q8_0"], 9, 96, seed=2)]
        ),
        QuantizedLinear([random_weight(q4, 17, 64, seed=3)], bias=torch.randn(17)),
    ]


def test_parts_move_into_one_aligned_buffer_with_their_bytes_and_products() -> None:
    linears = _linears()
    before = [[p.data.clone() for p in linear.parts] for linear in linears]
    x = [torch.randn(3, linear.in_features) for linear in linears]
    expected = [linear(xi) for linear, xi in zip(linears, x, strict=True)]
    buffer = weight_arena.pack_quantized(linears)
    assert buffer is not None and buffer.data_ptr() % weight_arena.HUGE_PAGE == 0
    end = buffer.data_ptr() + buffer.numel()
    previous = buffer.data_ptr()
    for linear, old in zip(linears, before, strict=True):
        for part, data in zip(linear.parts, old, strict=True):
            assert torch.equal(part.data, data)
            start = part.data.data_ptr()  # in the buffer, in order, on a cache line
            assert previous <= start and start + part.nbytes <= end
            assert start % weight_arena.ALIGN == 0
            previous = start + part.nbytes
    for linear, xi, want in zip(linears, x, expected, strict=True):
        assert torch.equal(linear(xi), want)


def test_switched_off_the_parts_stay_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_arena.ENABLE_ENV, "0")
    linears = _linears()
    parts = [list(linear.parts) for linear in linears]
    assert weight_arena.pack_quantized(linears) is None
    assert [list(linear.parts) for linear in linears] == parts


def test_nothing_to_pack() -> None:
    assert weight_arena.pack_quantized([]) is None


def _mapping(address: int) -> dict[str, list[str]]:
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
        fields = _mapping(address)
        assert "hg" in fields["VmFlags"]  # madvise(MADV_HUGEPAGE) took
        # anonymous, not shmem (a shared mapping's huge pages follow another setting)
        assert int(fields["Anonymous"][0]) > 0
