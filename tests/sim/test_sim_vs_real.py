"""The simulator replays a real run: the same steps, and times of the same order.

A small random llama runs on the real engine core (``replay_measured``: one torch thread, each
step timed by this thread's CPU time, the fastest of three forwards, so other load on the
machine inflates it little). A cost model is fitted (``CostModel.fit``) on the measured steps of
two calibration workloads; the simulator then replays a third workload, run for real beside
them. Step plans must match exactly; times are checked only within a wide factor (how close
the simulator gets on a quiet machine is measured by scripts/sim_check.py, not asserted here:
a timing bound in a unit test fails on a busy machine).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from asyncengine.common.config import EngineConfig
from asyncengine.sim import CostModel, Simulator, StepFeatures, simulate
from asyncengine.sim.sim_vs_real import (
    MeasuredRun,
    by_name,
    compare,
    replay_measured,
    replay_measured_together,
)
from asyncengine.workloads import Arrivals, WorkloadRequest, hot_scan, random_lengths

pytestmark = pytest.mark.slow
WIDE = 2.0  # simulated and measured times agree within this factor
# Big enough that tokens, not Python overhead, dominate a step; small enough for CI.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 2048, 512, 1536, 4, 8, 2
MODEL: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(directory: Path) -> Path:
    """A random llama checkpoint (config.json + model.safetensors), without transformers."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODEL))
    h, inter, kv_size = HIDDEN, INTERMEDIATE, KV_HEADS * HIDDEN // HEADS
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": randn(VOCAB, h), "model.norm.weight": torch.ones(h)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": randn(h, h),
            p + "self_attn.k_proj.weight": randn(kv_size, h),
            p + "self_attn.v_proj.weight": randn(kv_size, h),
            p + "self_attn.o_proj.weight": randn(h, h),
            p + "mlp.gate_proj.weight": randn(inter, h),
            p + "mlp.up_proj.weight": randn(inter, h),
            p + "mlp.down_proj.weight": randn(h, inter),
        }
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(directory / "model.safetensors"),
    )
    return directory


def workload(num_requests: int, seed: int) -> list[WorkloadRequest]:
    """Random prompt and output lengths, all queued at once."""
    return random_lengths(
        num_requests,
        vocab_size=VOCAB,
        input_median=64.0,
        input_sigma=0.6,
        output_median=16.0,
        output_sigma=0.5,
        max_input_len=512,
        max_output_len=48,
        seed=seed,
    )


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model_dir = write_model(tmp_path_factory.mktemp("sim_vs_real") / "model")
    # A 256-token prefill budget spreads the burst over mixed steps of a few prompts each:
    # the torch attention pads a step's prompts to its longest, which the cost model's
    # features do not see, so one step of 48 ragged prompts would not be predicted.
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",  # bfloat16 matmuls are ~90x slower on a CPU without AVX-512 BF16
        device="cpu",
        attention_backend="torch",
        max_model_len=2048,
        kv_cache_tokens=16384,
        max_prefill_tokens=256,
        chunked_prefill_size=256,
        log_interval=0.0,
    )


@dataclass(slots=True)
class Runs:
    cost: CostModel  # fitted on the calibration runs' measured steps
    real: MeasuredRun  # the checked workload, run for real
    workload: list[WorkloadRequest]


@pytest.fixture(scope="module")
def runs(config: EngineConfig, one_thread: None) -> Runs:
    checked = workload(48, seed=0)
    # in lockstep, so that the calibration and the checked run see the same machine load
    *calibration, real = replay_measured_together(
        config, [workload(48, seed=1), workload(48, seed=2), checked], forward_repeats=3
    )
    cost = CostModel.fit(
        [f for run in calibration for f in run.step_features],
        [t for run in calibration for t in run.step_seconds],
        description="fitted on two calibration runs",
    )
    return Runs(cost, real, checked)


def test_cpu_clock_needs_one_torch_thread(config: EngineConfig) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="set_num_threads"):
            replay_measured(config, workload(1, seed=0))
    finally:
        torch.set_num_threads(previous)


def test_measured_replay_runs_every_request_to_its_length(runs: Runs) -> None:
    real = runs.real
    assert real.summary.num_completed == len(runs.workload)
    assert [r.output_tokens for r in real.records] == [w.output_len for w in runs.workload]
    assert all(t > 0 for t in real.step_seconds)
    # all arrive at 0, so the clock is exactly the sum of the measured steps
    assert real.virtual_seconds == pytest.approx(sum(real.step_seconds))
    last = max(r.finish_time for r in real.records if r.finish_time is not None)
    assert sum(real.step_seconds[:-1]) < last <= real.virtual_seconds


def test_simulator_schedules_the_same_steps(config: EngineConfig, runs: Runs) -> None:
    simulator = Simulator(config, runs.cost)
    features: list[StepFeatures] = []
    simulator.core.step_hooks.append(lambda plan: features.append(StepFeatures.of_plan(plan)))
    simulator.run(runs.workload)
    assert features == runs.real.step_features


def test_simulator_times_are_of_the_real_runs_order(config: EngineConfig, runs: Runs) -> None:
    simulated = simulate(config, runs.workload, runs.cost).summary
    rows = by_name(compare(simulated, runs.real.summary))
    report = {name: f"{row.simulated:.4g} vs {row.measured:.4g}" for name, row in rows.items()}
    for name in ("output throughput", "mean E2E", "duration"):
        ratio = rows[name].simulated / rows[name].measured
        assert 1 / WIDE < ratio < WIDE, report


def test_a_scaled_cost_model_scales_the_simulated_run(config: EngineConfig, runs: Runs) -> None:
    """All requests arrive at once, so the plans do not depend on step times: a cost model 30%
    faster gives the same steps, 30% shorter."""
    base = simulate(config, runs.workload, runs.cost)
    too_fast = CostModel(*(c * 0.7 for c in runs.cost.coefficients), description="30% too fast")
    fast = simulate(config, runs.workload, too_fast)
    assert fast.steps == base.steps
    assert fast.summary.duration == pytest.approx(0.7 * base.summary.duration, rel=1e-9)
    assert fast.summary.e2e.mean == pytest.approx(0.7 * base.summary.e2e.mean, rel=1e-9)


def test_simulator_and_real_run_hit_the_same_tokens_under_each_eviction_rule(
    config: EngineConfig, one_thread: None
) -> None:
    """A hot system prompt between one-off prompts that overflow a small pool: LRU evicts the
    hot prompt, LFU keeps it. One request at a time (100 s apart), so no step time changes a
    plan: the simulator must hit and evict exactly what the real executor does, rule by rule."""
    workload = hot_scan(
        18,
        hot_every=3,
        vocab_size=VOCAB,
        system_len=128,
        question_median=8.0,
        scan_median=128.0,
        max_scan_len=256,
        output_len=4,
        arrivals=Arrivals("interval", interval=100.0),
    )
    hits: dict[str, int] = {}
    for rule in ("lru", "lfu"):
        small = config.replace(kv_cache_tokens=448, max_model_len=384, eviction_policy=rule)
        real = replay_measured(small, workload)
        simulated = Simulator(small).run(workload)
        assert [r.cached_tokens for r in simulated.records] == [
            r.cached_tokens for r in real.records
        ], rule
        assert simulated.scheduler_stats["evictions"] == real.stats["evictions"] > 0, rule
        hits[rule] = real.summary.cached_tokens
    assert hits["lfu"] > hits["lru"]  # the rule is in charge on both sides
