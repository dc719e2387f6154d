"""The adapter shipped in tests/data (scripts/make_lora.py trained it on README.md, rank 4 on
q/v, float16) over the embedded model as stored, Q4_1 blocks and all: it loads, it changes what
the model writes, and the native kernel agrees with the torch reference on its updates."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.config import EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.kernels.cpu import lora_native

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "smollm2-lora-r4"
PROMPT = "asyncengine is an LLM serving engine"


def test_the_shipped_adapter_is_small() -> None:
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) <= 2 << 20


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
async def test_the_shipped_adapter_changes_the_quantized_models_output(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native:
        monkeypatch.setattr(lora_native, "prepare", lambda *args: None)
        monkeypatch.setattr(lora_native, "_library", lambda: None)
    config = EngineConfig(
        model=DEFAULT_MODEL, loras={"readme": str(SHIPPED)}, log_interval=0, device="cpu"
    )
    params = {
        lora: SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, lora=lora)
        for lora in (None, "readme")
    }
    async with AsyncEngine(config) as engine:
        assert engine.executor.weights_summary.count("Q4_1")  # type: ignore[attr-defined]
        base = await engine.generate(PROMPT, params[None])
        adapted = await engine.generate(PROMPT, params["readme"])
        again = await engine.generate(PROMPT, params["readme"])  # its prefix cached, keyed
    assert adapted.token_ids != base.token_ids
    assert again.token_ids == adapted.token_ids
