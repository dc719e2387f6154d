"""dtype = "auto" on CPU picks the dtype whose matmuls this machine runs faster."""

from __future__ import annotations

import pytest
import torch

from asyncengine.common.config import EngineConfig
from asyncengine.executor.cpu import cpu_dtype
from asyncengine.executor.device import pick_dtype


@pytest.mark.parametrize(
    ("bf16_seconds", "fp32_seconds", "expected"),
    [
        (0.001, 0.004, torch.bfloat16),  # AMX / AVX-512 BF16: bf16 ~4x faster
        (0.090, 0.001, torch.float32),  # AVX2 only: bf16 takes a slow path
    ],
)
def test_auto_follows_the_faster_matmul(
    monkeypatch: pytest.MonkeyPatch, bf16_seconds: float, fp32_seconds: float, expected: torch.dtype
) -> None:
    timings = {torch.bfloat16: bf16_seconds, torch.float32: fp32_seconds}
    monkeypatch.setattr(cpu_dtype, "cpu_matmul_seconds", timings.__getitem__)
    config = EngineConfig(model="smollm2-135m", dtype="auto")
    assert pick_dtype(config.dtype, torch.device("cpu")) is expected


def test_probe_times_both_dtypes_on_this_machine() -> None:
    chosen = cpu_dtype.fastest_cpu_dtype()
    bf16, fp32 = (cpu_dtype.cpu_matmul_seconds(d) for d in (torch.bfloat16, torch.float32))
    assert 0 < bf16 < 1 and 0 < fp32 < 1
    assert chosen is (torch.bfloat16 if bf16 <= fp32 else torch.float32)


def test_explicit_dtype_is_kept() -> None:
    config = EngineConfig(model="smollm2-135m", dtype="bfloat16")
    assert pick_dtype(config.dtype, torch.device("cpu")) is torch.bfloat16
    assert (
        pick_dtype("bf16", "cpu") is torch.bfloat16
        and pick_dtype(torch.float32, "cpu") is torch.float32
    )
    with pytest.raises(ValueError, match="float16.*refused on CPU"):
        pick_dtype("float16", "cpu")
