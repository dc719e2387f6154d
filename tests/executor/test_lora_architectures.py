"""LoRA on every architecture the engine serves, against HF transformers + PEFT (float32): the
adapter lands where PEFT puts it whatever follows the projection (Qwen2's q/k/v biases,
Qwen3's and Gemma 3's per-head q/k norms, Gemma 2's soft-caps and four norms a layer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.kernels.cpu import cpu_native
from tests.conftest import TinyCheckpoint
from tests.executor.lora_support import PeftOracle, make_lora_script
from tests.executor.test_lora_parity import TOLERANCE, _harness

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 17, 33, 8, 41, 9, 60, 3, 22], [70, 12, 4, 88, 31, 6, 50]]
DECODE_STEPS = 4


@pytest.mark.parametrize(
    "name", ["qwen2_bias", "qwen3_qk_norm", "gemma", "gemma2", "gemma3", "mistral_window"]
)
def test_an_adapter_on_each_architecture_matches_peft(
    tiny_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path, name: str
) -> None:
    ckpt = tiny_checkpoints[name]
    script = make_lora_script()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    path = script.random_adapter(base, tmp_path / "all", 4, ALL_TARGETS, 8.0, seed=3)
    oracle = PeftOracle(ckpt.path, {"all": path})
    rows: list[tuple[str | None, list[int]]] = [("all", PROMPTS[0]), (None, PROMPTS[0])]
    rows.append(("all", PROMPTS[1]))
    h = _harness(ckpt, {"all": path}, num_requests=len(rows))
    # with a compiler the decodes run in the fused native step, its LoRA rows included
    assert (h.runner.model.native_decode is not None) == cpu_native.compiler_found()

    def greedy(n: int) -> list[SamplingInfo]:
        return [SamplingInfo(SamplingParams(temperature=0.0), [], []) for _ in range(n)]

    tokens = [list(prompt) for _, prompt in rows]
    extends = [
        Segment(f"r{row}", row, prompt, 0, True, lora=lora)
        for row, (lora, prompt) in enumerate(rows)
    ]
    logits = h.runner.forward_logits(BatchPlan(step=0, extends=extends, sampling=greedy(3)))
    for step in range(DECODE_STEPS):
        for row, (lora, _) in enumerate(rows):
            want = oracle.logits(lora, tokens[row])[-1]
            got = logits[row]
            assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), (
                f"{name} row {row} ({lora}) step {step}: max diff {(got - want).abs().max():.2e}"
            )
            tokens[row].append(int(got.argmax()))
        decodes = [
            Segment(f"r{row}", row, [tokens[row][-1]], len(tokens[row]) - 1, True, lora=lora)
            for row, (lora, _) in enumerate(rows)
        ]
        logits = h.runner.forward_logits(
            BatchPlan(step=1 + step, decodes=decodes, sampling=greedy(3))
        )
    assert not torch.allclose(oracle.logits("all", PROMPTS[0]), oracle.logits(None, PROMPTS[0]))
