"""A safetensors checkpoint's load holds its weights' bytes once at the peak, not the file's
mapped pages beside their copies (executor/loader/hf_dir.py, ``load_weights``). Measured from
/proc/self/status, as test_malloc_reuse.py measures: the resident bytes before the load against
their high-water mark after it (the process's own peak so far can sit above its resident bytes
before the load, which would hide a doubled peak)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.python_subprocess import run_python

_PEAK_CHILD = """
import sys
from pathlib import Path
import torch
from asyncengine.executor.loader.hf_dir import load_weights

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

before = status("VmRSS")
weights = load_weights(sys.argv[1], torch.bfloat16)
print(status("VmHWM") - before, sum(t.nbytes for t in weights.values()))
"""


def test_loading_a_checkpoint_holds_its_bytes_once_at_the_peak(tmp_path: Path) -> None:
    """One map of the whole file kept each page read resident beside the tensor copied from
    it, so the peak was twice the weights; with a map per tensor it is the weights' bytes."""
    torch.manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(4096, 1536).to(torch.bfloat16) for i in range(8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    growth, weight_bytes = map(int, run_python(_PEAK_CHILD, str(tmp_path)).split())
    assert weight_bytes == 8 * 4096 * 1536 * 2
    assert growth < 1.35 * weight_bytes, (growth, weight_bytes)
