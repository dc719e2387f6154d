"""The embedded default model end to end: batched greedy output equals HF transformers'."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.executor.loader import resolve_model
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.decode_step_native import DecodeStepModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_continuations() -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from asyncengine.text.tokenizer import Tokenizer

    path = resolve_model("smollm2-135m", torch.float32)
    tokenizer = Tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, ids))
    # one left-padded batch: in fp32 it gives the same greedy tokens as one prompt at a time
    inputs = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [row[width:].tolist() for row in out]


@pytest.mark.slow
def test_default_model_fp32_greedy_batch_equals_hf(
    hf_continuations: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fused_rows: list[int] = []  # the rows of each fused decode step (float32 weights: F32 rows)
    step = DecodeStepModel.step

    def counting(self: DecodeStepModel, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        fused_rows.append(hidden.shape[0])
        return step(self, hidden, *args)

    monkeypatch.setattr(DecodeStepModel, "step", counting)

    async def run() -> list[list[int]]:
        # the file expanded to float32 (HF's weights); the file as stored (int8 activations
        # against its blocks) is held to its own bounds in test_quantized_model.py
        config = EngineConfig(
            model="smollm2-135m",
            dtype="float32",
            quantization="none",
            kv_cache_tokens=4096,
            log_interval=0,
        )
        async with AsyncEngine(config) as engine:
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0
            )
            outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
            assert engine.scheduler.step_count < len(PROMPTS) * NEW_TOKENS, (
                "requests were not batched"
            )
        return [o.token_ids for o in outs]

    assert asyncio.run(run()) == hf_continuations
    if cpu_native.compiler_found():  # the decode steps ran in the fused native step, batched
        assert len(fused_rows) >= NEW_TOKENS - 1 and max(fused_rows) == len(PROMPTS)
