"""LoRA in the forward against HF transformers + PEFT (float32, adapters not merged): one
batch mixes three adapters of different ranks, targets and scalings with the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.lora.registry import LoraRegistry
from asyncengine.kernels.cpu import lora_native
from tests.conftest import TinyCheckpoint
from tests.executor.lora_support import PeftOracle, write_adapters
from tests.executor.test_model_parity import Harness

TOLERANCE = 1e-4
# row -> (adapter, prompt): the same prompt under two adapters and the base, others apart
REQUESTS: list[tuple[str | None, list[int]]] = [
    ("r4", [5, 17, 33, 8, 41, 9, 60, 3, 22]),
    ("r8", [5, 17, 33, 8, 41, 9, 60, 3, 22]),
    ("r16", [70, 12, 4, 88, 31, 6, 50, 19, 27, 44, 65, 13, 7]),
    (None, [5, 17, 33, 8, 41, 9, 60, 3, 22]),
]
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_adapters(tiny_llama.path, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def oracle(tiny_llama: TinyCheckpoint, adapters: dict[str, Path]) -> PeftOracle:
    return PeftOracle(tiny_llama.path, adapters)


def _harness(ckpt: TinyCheckpoint, adapters: dict[str, Path], num_requests: int = 4) -> Harness:
    h = Harness(ckpt, page_size=4, num_requests=num_requests)
    config = ModelConfig.from_hf_dict(ckpt.hf_config)
    registry = LoraRegistry(config, 64, None, torch.float32, torch.device("cpu"))
    for name, path in adapters.items():
        registry.add(name, path)
    h.runner.loras = registry
    return h


def _greedy(n: int) -> list[SamplingInfo]:
    return [SamplingInfo(SamplingParams(temperature=0.0), [], []) for _ in range(n)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_mixed_batch_logits_and_greedy_tokens_match_peft(
    tiny_llama: TinyCheckpoint,
    adapters: dict[str, Path],
    oracle: PeftOracle,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if native:
        assert lora_native.available()
    else:
        monkeypatch.setattr(lora_native, "_library", lambda: None)
    h = _harness(tiny_llama, adapters)
    # a prompt in two chunks (the first not sampled), the others whole
    first = REQUESTS[2][1][:5]
    extends = [
        Segment(f"r{row}", row, prompt, 0, True, lora=lora)
        for row, (lora, prompt) in enumerate(REQUESTS)
        if row != 2
    ]
    extends.insert(2, Segment("r2", 2, first, 0, False, lora=REQUESTS[2][0]))
    h.runner.forward_logits(BatchPlan(step=0, extends=extends, sampling=_greedy(3)))
    rest = REQUESTS[2][1][5:]
    tail = Segment("r2", 2, rest, 5, True, lora=REQUESTS[2][0])
    last = h.runner.forward_logits(BatchPlan(step=1, extends=[tail], sampling=_greedy(1)))
    logits = [None, None, last[0], None]
    seen = h.runner.forward_logits(
        BatchPlan(
            step=2,
            extends=[
                Segment(f"r{row}", row, prompt[-1:], len(prompt) - 1, True, lora=lora)
                for row, (lora, prompt) in enumerate(REQUESTS)
                if row != 2
            ],
            sampling=_greedy(3),
        )
    )  # the last prompt token again, over its own KV: the same logits as the first pass
    for i, row in enumerate((0, 1, 3)):
        logits[row] = seen[i]
    tokens = [list(prompt) for _, prompt in REQUESTS]
    for step in range(DECODE_STEPS + 1):
        for row, (lora, _) in enumerate(REQUESTS):
            want = oracle.logits(lora, tokens[row])[-1]
            got = logits[row]
            assert got is not None
            assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), (
                f"row {row} ({lora}) step {step}: max diff {(got - want).abs().max():.2e}"
            )
            tokens[row].append(int(got.argmax()))
        if step == DECODE_STEPS:
            break
        decodes = [
            Segment(f"r{row}", row, [tokens[row][-1]], len(tokens[row]) - 1, True, lora=lora)
            for row, (lora, _) in enumerate(REQUESTS)
        ]
        out = h.runner.forward_logits(
            BatchPlan(step=3 + step, decodes=decodes, sampling=_greedy(4))
        )
        logits = list(out)
    for row, (lora, prompt) in enumerate(REQUESTS):
        assert tokens[row][len(prompt) :] == oracle.greedy(lora, prompt, DECODE_STEPS + 1)
    # the adapters change the model: the same prompt gives other logits under each
    same = [oracle.logits(lora, REQUESTS[0][1])[-1] for lora in ("r4", "r8", None)]
    assert not torch.allclose(same[0], same[2], atol=1e-3)
    assert not torch.allclose(same[1], same[2], atol=1e-3)
