"""Deterministic mode on one thread or on all: the same logits, bit for bit, so that the CPU
runner may choose a step's count (executor/cpu/step_threads.py) without breaking the mode's
promise. Checked on the kernels the mode runs: the padded torch attention (the tiny model), the
native extend kernel with the group kernels (the embedded model as stored), oneDNN's row-blocked
products (the embedded model dense) and the int8 product (K formats)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.deterministic import products_match_on_one_thread
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.linear import Linear
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import DEFAULT_MODEL
from asyncengine.executor.loader.hf_dir import load_hf_config
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.quant_formats import QuantizedTensor
from tests.conftest import TinyCheckpoint
from tests.executor.test_deterministic import _k_format_llama
from tests.executor.test_model_parity import sampling_for
from tests.executor.test_step_threads import _on_one_thread_and_on_two
from tests.kernels.test_quant_i8gemm import needs_k_format_i8

PAGE = 16
PROMPTS = (300, 120, 45, 7)  # at most the model's context less a few decodes


def prompt_lengths(config: ModelConfig) -> list[int]:
    return [min(n, config.max_position_embeddings - 8) for n in PROMPTS]


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def deterministic_runner(
    config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedTensor], dtype: torch.dtype
) -> ModelRunner:
    """A deterministic runner over a pool of shuffled pages, one row per prompt of PROMPTS."""
    per_row = -(-(max(prompt_lengths(config)) + 8) // PAGE)
    pages = per_row * len(PROMPTS)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, pages, PAGE, dtype)
    table = PageTable(len(PROMPTS), per_row)
    order = np.random.default_rng(0).permutation(pages)
    for row in range(len(PROMPTS)):
        table.set_pages(row, 0, order[row * per_row : (row + 1) * per_row])
    return ModelRunner(config, weights, pool, table, dtype, deterministic=True)


def plans(config: ModelConfig) -> dict[str, BatchPlan]:
    """The prompts' prefill, then steps over their cache: decodes of one row and of several,
    a prompt's chunk beside a decode, a prompt again from its start."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, config.vocab_size - 1, n).tolist() for n in prompt_lengths(config)]
    rows = range(len(prompts))
    decodes = [Segment(f"r{i}", i, [5 + i], len(prompts[i]), True) for i in rows]
    return {
        "prefill": BatchPlan(
            step=0,
            extends=[Segment(f"r{i}", i, prompts[i], 0, True) for i in rows],
            sampling=sampling_for(len(prompts)),
        ),
        "one decode": BatchPlan(step=1, decodes=decodes[:1], sampling=sampling_for(1)),
        "decodes": BatchPlan(step=1, decodes=decodes, sampling=sampling_for(len(prompts))),
        "chunk beside a decode": BatchPlan(
            step=1,
            extends=[Segment("r2", 2, prompts[2][-40:], len(prompts[2]) - 40, True)],
            decodes=decodes[:1],
            sampling=sampling_for(2),
        ),
        "prompt again": BatchPlan(
            step=1, extends=[Segment("r1", 1, prompts[1], 0, True)], sampling=sampling_for(1)
        ),
    }


def assert_same_logits_on_one_thread_and_on_two(runner: ModelRunner) -> None:
    assert runner.step_threads is not None  # the runner chooses each step's count
    steps = plans(runner.config)
    runner.forward_logits(steps.pop("prefill"))  # the cache the other steps read
    for name, plan in steps.items():
        step: Callable[[], torch.Tensor] = lambda plan=plan: runner.forward_logits(plan)  # noqa: E731
        one, two = _on_one_thread_and_on_two(step)
        assert torch.isfinite(one).all(), name
        assert torch.equal(one, two), name


def test_the_tiny_model_gives_the_same_logits_on_one_thread_and_on_two(
    tiny_llama: TinyCheckpoint, two_threads: None
) -> None:
    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    runner = deterministic_runner(config, dict(tiny_llama.load_weights()), torch.bfloat16)
    assert_same_logits_on_one_thread_and_on_two(runner)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_the_embedded_model_gives_the_same_logits_on_one_thread_and_on_two(
    quantization: str, two_threads: None
) -> None:
    """``auto``: its Q4_1 / Q8_0 blocks as stored (the group kernels); ``none``: dense bfloat16
    weights, oneDNN's products on 32-row blocks."""
    loaded = load_model(DEFAULT_MODEL, torch.bfloat16, torch.device("cpu"), quantization)
    config = ModelConfig.from_hf_dict(load_hf_config(loaded.model_dir))
    runner = deterministic_runner(config, loaded.weights, torch.bfloat16)
    assert_same_logits_on_one_thread_and_on_two(runner)


@needs_k_format_i8
def test_k_format_projections_give_the_same_logits_on_one_thread_and_on_two(
    two_threads: None,
) -> None:
    config, weights = _k_format_llama()
    runner = deterministic_runner(config, weights, torch.float32)
    assert_same_logits_on_one_thread_and_on_two(runner)


def test_a_product_that_splits_its_sum_by_the_thread_count_keeps_every_step_on_all_threads(
    tiny_llama: TinyCheckpoint, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a product's bits follow the thread count (here one that sums K in as many pieces
    as torch has threads), the runner keeps the process's count for every step."""
    multiply = Linear._multiply

    def split_by_threads(self: Linear, x: torch.Tensor) -> torch.Tensor:
        pieces = torch.get_num_threads()
        cuts = [x.shape[-1] * i // pieces for i in range(pieces + 1)]
        out = multiply(self, x.new_zeros(x.shape))
        for start, end in zip(cuts, cuts[1:], strict=False):
            part = x.new_zeros(x.shape)
            part[:, start:end] = x[:, start:end]
            out = out + multiply(self, part)  # a partial sum over this piece of K
        return out

    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    weights = dict(tiny_llama.load_weights())
    assert products_match_on_one_thread(
        deterministic_runner(config, weights, torch.bfloat16).model, 2
    )
    monkeypatch.setattr(Linear, "_multiply", split_by_threads)
    runner = deterministic_runner(config, weights, torch.bfloat16)
    assert runner.step_threads is None
