"""Embedding requests on the engine core: prefill only, through the same scheduler, policy and
prefix cache, pooled across chunks (asyncengine/common/pooling.py), over the model-free executor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.common.pooling import PooledEmbedding
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.policies.base import PolicyContext
from asyncengine.policies.fcfs import FCFSPolicy
from tests.core.test_lifecycle import ended_by, run
from tests.fake_executor import FakeExecutor, reference_embedding, reference_output
from tests.scheduler.test_scheduler import Clock

PROMPT = [(7 * i + 3) % 997 + 1 for i in range(37)]


class RecordingPolicy(FCFSPolicy):
    """FCFS that remembers every request it was asked to order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        self.seen.update(req.rid for req in waiting)
        return super().order(waiting, ctx)


def make(
    pooling: str = "mean", policy: RecordingPolicy | None = None, **overrides: object
) -> tuple[EngineCore, Clock, list[BatchPlan]]:
    clock = Clock()
    values: dict[str, object] = {
        "page_size": 4,
        "kv_cache_tokens": 64 * 4,
        "log_interval": 0,
        **overrides,
    }
    config = EngineConfig.from_dict(values)
    executor = FakeExecutor(1024, pooling=pooling)
    policies = None if policy is None else (policy, None)
    core = build_core(config, executor, clock, policies)
    plans: list[BatchPlan] = []
    core.step_hooks.append(lambda plan: core.check_invariant())
    core.step_hooks.append(plans.append)
    return core, clock, plans


def embedding_request(rid: str, prompt: list[int], pooling: str, clock: Clock) -> Request:
    req = Request(rid, prompt, SamplingParams(max_new_tokens=1), clock())
    req.embedding = PooledEmbedding(pooling)
    return req


def generation(rid: str, prompt: list[int], n: int, clock: Clock) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0), clock())


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("chunk", [0, 8])
def test_pooled_across_chunks_equals_the_reference_and_never_decodes(
    pooling: str, chunk: int
) -> None:
    core, clock, plans = make(pooling, chunked_prefill_size=chunk)
    req = embedding_request("e", PROMPT, pooling, clock)
    core.add(req)
    reports = run(core, clock)
    assert ended_by(reports) == {"e": "stop"}
    assert req.embedding is not None
    assert req.embedding.vector == pytest.approx(reference_embedding(PROMPT, pooling), rel=1e-12)
    assert req.output_ids == [] and not any(plan.decodes or plan.sampling for plan in plans)
    assert len(plans) == (1 if not chunk else -(-len(PROMPT) // chunk))
    # its pages are the cache's now: a generation with the same prompt computes 1 page at most
    assert core.kv.match_length(PROMPT) == (len(PROMPT) - 1) // 4 * 4
    assert core.kv.stats()["pages_used"] == 0


def test_last_token_pooling_takes_the_cached_prefix_and_mean_pooling_does_not() -> None:
    for pooling, cached in (("last", 36), ("mean", 0)):
        core, clock, plans = make(pooling)
        core.add(generation("g", PROMPT, 3, clock))
        run(core, clock)
        req = embedding_request("e", PROMPT, pooling, clock)
        core.add(req)
        run(core, clock)
        assert req.cached_tokens == cached
        assert plans[-1].extends[0].start_pos == cached
        assert req.embedding is not None
        assert req.embedding.vector == pytest.approx(reference_embedding(PROMPT, pooling))


def test_batched_with_generations_and_seen_by_the_policy() -> None:
    policy = RecordingPolicy()
    core, clock, plans = make("mean", policy, chunked_prefill_size=16)
    prompts = [PROMPT[: 9 + 5 * i] for i in range(4)]
    gens = [generation(f"g{i}", p, 5, clock) for i, p in enumerate(prompts)]
    embs = [embedding_request(f"e{i}", p[::-1], "mean", clock) for i, p in enumerate(prompts)]
    for g, e in zip(gens, embs, strict=True):
        core.add(g)
        core.add(e)
    run(core, clock)
    assert policy.seen >= {req.rid for req in embs}
    for g, p in zip(gens, prompts, strict=True):
        assert g.output_ids == reference_output(p, 5)
    for e, p in zip(embs, prompts, strict=True):
        assert e.embedding is not None and e.finish_reason == "stop"
        assert e.embedding.vector == pytest.approx(reference_embedding(p[::-1], "mean"))
    assert any(plan.decodes and any(s.pool for s in plan.extends) for plan in plans)
    assert core.kv.stats()["pages_used"] == 0


def test_an_embedding_needs_no_room_for_future_tokens() -> None:
    clock = Clock()
    req = embedding_request("e", PROMPT, "mean", clock)
    assert req.prefill_only and req.future_tokens(1024) == 0


def test_aborted_mid_chunk_frees_its_pages() -> None:
    core, clock, _ = make("mean", chunked_prefill_size=8)
    req = embedding_request("e", PROMPT, "mean", clock)
    core.add(req)
    core.step()
    assert core.abort("e")
    assert ended_by([core.events()]) == {"e": "abort"}
    assert not core.has_work() and core.kv.stats()["pages_used"] == 0
    core.check_invariant()


def test_the_pooling_a_model_dir_asks_for(tmp_path: Path) -> None:
    from asyncengine.executor.loader.pooling_config import model_pooling

    assert model_pooling(tmp_path, "auto") == "mean"  # no sentence-transformers config
    assert model_pooling(tmp_path, "last") == "last"
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(
        json.dumps({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    )
    assert model_pooling(tmp_path, "auto") == "last"
    assert model_pooling(tmp_path, "mean") == "mean"
    config.write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="cls_token"):
        model_pooling(tmp_path, "auto")
