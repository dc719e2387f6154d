"""Importing asyncengine first asks torch's allocator for huge pages (asyncengine/hugepage_tensors.py):
a large CPU tensor made afterwards sits in a mapping advised to use them; a setting already in the
environment is kept."""

from __future__ import annotations

import json
import sys

import pytest

from tests.python_subprocess import run_python

# the VmFlags of the mapping holding a fresh 8 MiB tensor, made after importing asyncengine with
# the setting given as argv[1] ("-": none; the test process's own, which its import set, dropped)
CHILD = """
import json, os, sys
os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
if sys.argv[1] != "-":
    os.environ["THP_MEM_ALLOC_ENABLE"] = sys.argv[1]
import asyncengine
import torch

tensor = torch.empty(8 << 20, dtype=torch.uint8)
tensor.fill_(1)
address = tensor.data_ptr()
flags, inside = [], False
for line in open("/proc/self/smaps"):
    head, *rest = line.split()
    if "-" in head and not head.endswith(":"):
        low, high = (int(v, 16) for v in head.split("-"))
        inside = low <= address < high
    elif inside and head == "VmFlags:":
        flags = rest
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "flags": flags}))
"""


def _child(setting: str) -> dict[str, object]:
    out: dict[str, object] = json.loads(run_python(CHILD, setting).strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_large_tensor_after_the_import_is_advised_to_use_huge_pages() -> None:
    out = _child("-")
    assert out["env"] == "1"
    assert "hg" in out["flags"]  # type: ignore[operator]  # madvise(MADV_HUGEPAGE) took


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_setting_in_the_environment_is_kept() -> None:
    out = _child("0")
    assert out["env"] == "0"
    assert "hg" not in out["flags"]  # type: ignore[operator]
