"""`run_server` with a real (tiny random) model: a shadow policy, the admin endpoint and a live
trace in one served run; the shadow changes no output (greedy tokens equal a run without it)
and the recorded trace reads back as the traffic that was served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from asyncengine.api.engine import AsyncEngine
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.server.serve import run_server
from asyncengine.workloads.live_trace import load_live_trace
from tests.server_support import engine_config, tiny_model_dir

PROMPTS = [f"Request number {k}: tell me about the color {c}." for k, c in enumerate("rgbcmyk")]
ADMIN = "admin-token"


@pytest.mark.slow
async def test_a_served_run_with_shadow_admin_swap_and_trace(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    model = tiny_model_dir(tmp_path_factory)
    config = engine_config(model, shadow_policy="sjf", max_running_requests=2)
    trace = tmp_path / "live.jsonl"
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        run_server(
            config,
            "127.0.0.1",
            0,
            log_interval=0,
            stop_event=stop,
            on_ready=port.set_result,
            install_signal_handlers=False,
            admin_token=ADMIN,
            record_trace=str(trace),
        )
    )
    base = f"http://127.0.0.1:{await asyncio.wait_for(port, 120)}"
    served: dict[str, list[int]] = {}

    async def complete(session: aiohttp.ClientSession, k: int, **extra: object) -> None:
        body = {
            "text": PROMPTS[k],
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "user": f"u{k % 2}",
            **extra,
        }
        async with session.post(base + "/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            served[PROMPTS[k]] = (await resp.json())["output_ids"]

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(complete(session, k, priority=k % 3) for k in range(4)))
        async with session.post(
            base + "/admin/policy",
            json={
                "policy": "priority+dynamic-chunking",
                "options": {"priority": {"preempt": True}},
            },
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as resp:
            assert resp.status == 200 and (await resp.json())["previous"] == "fcfs"
        await asyncio.gather(*(complete(session, k, priority=-k) for k in range(4, 7)))
        async with session.get(
            base + "/admin/policy", headers={"Authorization": f"Bearer {ADMIN}"}
        ) as resp:
            state = await resp.json()
        async with session.get(base + "/metrics") as resp:
            metrics = await resp.text()
    stop.set()
    assert await server == 0
    assert state["policy"] == "priority+dynamic-chunking" and state["policy_swaps"] == 1
    assert state["shadow"]["policy"] == "sjf" and state["shadow"]["decisions"] > 0
    assert 'asyncengine_shadow_decisions_total{shadow="sjf"}' in metrics
    assert "asyncengine_admission_blocked_total" in metrics

    # the trace is the traffic: every request, its prompt and what it generated
    live = load_live_trace(trace)
    assert live.header["policy"] == "fcfs" and len(live.requests) == len(PROMPTS)
    (swap,) = live.policy_swaps  # the admin swap, between the two batches of requests
    assert (swap.policy, swap.options) == (
        "priority+dynamic-chunking",
        {"priority": {"preempt": True}},
    )
    arrivals = sorted(r.arrival_time for r in live.requests)
    assert arrivals[3] <= swap.time <= arrivals[4]
    assert {r.tenant for r in live.requests} == {"u0", "u1"}
    assert sorted(r.output_len for r in live.requests) == sorted(len(v) for v in served.values())
    assert live.steps and all(s.seconds > 0 for s in live.steps)

    # a shadow changes nothing: the same greedy tokens from an engine without one
    async with AsyncEngine(engine_config(model)) as engine:
        for prompt, tokens in served.items():
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0))
            assert out.token_ids == tokens, prompt
