"""LoRA rows in the fused decode step (kernels/cpu/cpu_step_lora.h): a decode step mixing
adapters of different ranks and targets with base rows runs in one native call, and its logits
are HF transformers + PEFT's (float32, adapters not merged) within the parity tolerance, on the
AVX-512 and the AVX2 build, on one thread and on two (each expands its own share of outputs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.quantized import quantize_int8
from asyncengine.executor.lora.registry import LoraRegistry
from asyncengine.executor.runner import ModelRunner
from tests.conftest import TinyCheckpoint
from tests.executor.fused_step_checks import step_built_with
from tests.executor.lora_support import PeftOracle, write_adapters
from tests.executor.test_lora_parity import REQUESTS, TOLERANCE, _greedy, _harness
from tests.executor.test_native_decode import FLIP_TOLERANCE, Pair
from tests.native_support import needs_native

pytestmark = needs_native

DECODE_STEPS = 6
# each request's adapter index in a step of all REQUESTS (the step's adapters by name; -1: base)
NAMES = sorted({lora for lora, _ in REQUESTS if lora is not None})
ROW_ADAPTERS = [-1 if lora is None else NAMES.index(lora) for lora, _ in REQUESTS]
# more rows of one adapter than one pass over its weights takes (LORA_ROWS), among others
CROWDED = [
    *REQUESTS,
    ("r16", [9, 31, 77, 2, 18]),
    (None, [40, 41, 42]),
    ("r16", [64, 3, 3, 90, 15, 28]),
    ("r16", [11, 58, 23]),
    ("r16", [36, 6, 81, 47]),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_adapters(tiny_llama.path, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def oracle(tiny_llama: TinyCheckpoint, adapters: dict[str, Path]) -> PeftOracle:
    return PeftOracle(tiny_llama.path, adapters)


@pytest.fixture(params=["default", "avx2"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The step's library as built for this CPU (AVX-512 where it has it), or its AVX2 build."""
    with step_built_with(("-DQ_FORCE_AVX2",) if request.param == "avx2" else None):
        yield request.param


def _record_lora_steps(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The per-row adapter indexes of every fused step ``runner`` takes from now on."""
    model = runner.model.native_decode
    assert model is not None
    seen: list[list[int]] = []
    original = model.step

    def recording(*args: Any) -> torch.Tensor:
        lora = args[7] if len(args) > 7 else None  # step's arguments: hidden .. lora
        seen.append([] if lora is None else lora.rows.tolist())
        return original(*args)

    monkeypatch.setattr(model, "step", recording)
    return seen


def _prefill(runner: ModelRunner, requests: list[tuple[str | None, list[int]]]) -> list[int]:
    extends = [
        Segment(f"r{row}", row, prompt, 0, True, lora=lora)
        for row, (lora, prompt) in enumerate(requests)
    ]
    plan = BatchPlan(step=0, extends=extends, sampling=_greedy(len(requests)))
    return runner.forward_logits(plan).argmax(-1).tolist()


def _decode(
    runner: ModelRunner,
    requests: list[tuple[str | None, list[int]]],
    tokens: list[list[int]],
    step: int,
) -> torch.Tensor:
    decodes = [
        Segment(f"r{row}", row, [tokens[row][-1]], len(tokens[row]) - 1, True, lora=lora)
        for row, (lora, _) in enumerate(requests)
    ]
    return runner.forward_logits(
        BatchPlan(step=step, decodes=decodes, sampling=_greedy(len(requests)))
    )


@pytest.mark.parametrize("requests", [REQUESTS, CROWDED], ids=["one-row-each", "crowded"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_steps_with_mixed_adapters_match_peft(
    tiny_llama: TinyCheckpoint,
    adapters: dict[str, Path],
    oracle: PeftOracle,
    isa: str,
    threads: int,
    requests: list[tuple[str | None, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = _harness(tiny_llama, adapters, len(requests))
    assert h.runner.model.native_decode is not None
    seen = _record_lora_steps(h.runner, monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        firsts = _prefill(h.runner, requests)
        tokens = [[*prompt, first] for (_, prompt), first in zip(requests, firsts, strict=True)]
        for step in range(DECODE_STEPS):
            logits = _decode(h.runner, requests, tokens, 1 + step)
            for row, (lora, _) in enumerate(requests):
                want = oracle.logits(lora, tokens[row])[-1]
                assert torch.allclose(logits[row], want, atol=TOLERANCE, rtol=0), (
                    f"row {row} ({lora}) step {step}: "
                    f"max diff {(logits[row] - want).abs().max():.2e}"
                )
                tokens[row].append(int(logits[row].argmax()))
    finally:
        torch.set_num_threads(before)
    # every decode step ran fused, with the rows' adapters
    row_adapters = [-1 if lora is None else NAMES.index(lora) for lora, _ in requests]
    assert seen == [row_adapters] * DECODE_STEPS
    for row, (lora, prompt) in enumerate(requests):
        assert tokens[row][len(prompt) :] == oracle.greedy(lora, prompt, DECODE_STEPS + 1)


def test_one_stream_with_an_adapter_runs_fused_and_matches_peft(
    tiny_llama: TinyCheckpoint,
    adapters: dict[str, Path],
    oracle: PeftOracle,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch 1: the step's one-row attention path, the adapter on every projection."""
    h = _harness(tiny_llama, adapters)
    seen = _record_lora_steps(h.runner, monkeypatch)
    request = [("r8", REQUESTS[2][1])]
    tokens = [[*request[0][1], _prefill(h.runner, request)[0]]]
    for step in range(DECODE_STEPS):
        logits = _decode(h.runner, request, tokens, 1 + step)
        want = oracle.logits("r8", tokens[0])[-1]
        assert torch.allclose(logits[0], want, atol=TOLERANCE, rtol=0), step
        tokens[0].append(int(logits[0].argmax()))
    assert seen == [[0]] * DECODE_STEPS


def _lora_pair(
    ckpt: TinyCheckpoint, weights: dict[str, Any], adapters: dict[str, Path], dtype: torch.dtype
) -> Pair:
    pair = Pair(ckpt, weights, dtype=dtype)
    config = ModelConfig.from_hf_dict(ckpt.hf_config)
    for runner in pair.runners:
        registry = LoraRegistry(config, 64, None, dtype, torch.device("cpu"))
        for name, path in adapters.items():
            registry.add(name, path)
        runner.loras = registry
    return pair


def test_fused_lora_over_int8_weights_follows_the_layer_by_layer_path(
    tiny_llama: TinyCheckpoint,
    adapters: dict[str, Path],
    isa: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quantized base (interleaved row groups: the gate/up pairs' grouped path) with the
    adapters on its float32 activations: the same steps as the torch path adding them layer by
    layer, up to an activation's int8 rounding (test_native_decode.py's tolerance)."""
    pair = _lora_pair(tiny_llama, quantize_int8(tiny_llama.load_weights()), adapters, torch.float32)
    seen = _record_lora_steps(pair.native, monkeypatch)
    outputs: list[list[torch.Tensor]] = []
    for runner in pair.runners:
        firsts = _prefill(runner, REQUESTS)
        tokens = [[*prompt, first] for (_, prompt), first in zip(REQUESTS, firsts, strict=True)]
        steps = []
        for step in range(DECODE_STEPS):
            logits = _decode(runner, REQUESTS, tokens, 1 + step)
            steps.append(logits)
            for row in range(len(REQUESTS)):
                tokens[row].append(int(logits[row].argmax()))
        outputs.append(steps)
    assert seen == [ROW_ADAPTERS] * DECODE_STEPS
    for step, (got, want) in enumerate(zip(*outputs, strict=True)):
        assert torch.isfinite(got).all()
        error = float((got - want).abs().max()) / float(want.abs().max())
        assert error < FLIP_TOLERANCE, step
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), step


def test_bfloat16_adapters_in_the_fused_step_track_the_layer_by_layer_path(
    tiny_llama: TinyCheckpoint,
    adapters: dict[str, Path],
    oracle: PeftOracle,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bfloat16 model (int8 weights) keeps its adapters in bfloat16 (the kernel's bf16 loads): one decode
    step of three adapters and the base, after the same prefill on both paths, within the
    bfloat16 step's tolerance of the layer-by-layer path, and no further from PEFT than it."""
    weights = quantize_int8(tiny_llama.load_weights())
    pair = _lora_pair(tiny_llama, weights, adapters, torch.bfloat16)
    seen = _record_lora_steps(pair.native, monkeypatch)
    requests = REQUESTS[:4]
    results = []
    for runner in pair.runners:
        firsts = _prefill(runner, requests)
        tokens = [[*prompt, first] for (_, prompt), first in zip(requests, firsts, strict=True)]
        results.append((_decode(runner, requests, tokens, 1).float(), tokens))
    (fused, tokens), (layered, layered_tokens) = results
    assert tokens == layered_tokens
    assert seen == [ROW_ADAPTERS]
    scale = float(layered.abs().max())
    torch.testing.assert_close(fused, layered, atol=3e-2 * scale, rtol=0)
    want = torch.stack(
        [oracle.logits(lora, tokens[row])[-1] for row, (lora, _) in enumerate(requests)]
    )
    fused_error = float((fused - want).abs().max())
    assert fused_error <= 1.25 * float((layered - want).abs().max()) + 1e-3
    assert np.isfinite(fused_error)
