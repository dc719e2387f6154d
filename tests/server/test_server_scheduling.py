"""The scheduling controls over HTTP, on a model-free engine behind the real app on loopback:
priority / timeout / user (tenant) on the OpenAI and native endpoints, 408 for a request that
timed out before its first token, the admin policy endpoint and its tokens, the Prometheus
series of the scheduler's counters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.policies.base import Policy, PolicyContext
from asyncengine.server.scheduling_metrics import tenant_label
from tests.api.test_scheduling_e2e import engine
from tests.server_support import RunningServer, assert_no_leak, sse_json, start_server

HERE = "tests.server.test_server_scheduling"
ADMIN = "s3cret-admin"
API_KEY = "user-key"


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RunningServer]:
    eng = engine(delay=0.002, max_running_requests=1, policy="fcfs")
    await eng.start()
    seen: list[SamplingParams] = []
    stream = eng.stream

    def spy(prompt: Any, params: SamplingParams | None = None, **kw: Any) -> Any:
        assert params is not None
        seen.append(params)
        return stream(prompt, params, **kw)

    eng.stream = spy  # type: ignore[method-assign]
    eng.seen = seen  # type: ignore[attr-defined]
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN, api_key=API_KEY)
    yield running
    await running.stop()


def auth(token: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def post(
    session: aiohttp.ClientSession,
    server: RunningServer,
    path: str,
    body: dict[str, Any],
    **kw: Any,
) -> tuple[int, Any]:
    async with session.post(server.base_url + path, json=body, **kw) as resp:
        raw = await resp.read()
        return resp.status, (json.loads(raw) if raw.startswith(b"{") else raw)


async def test_openai_priority_timeout_and_user_reach_the_engine(server: RunningServer) -> None:
    async with aiohttp.ClientSession(headers=auth()) as session:
        status, body = await post(
            session,
            server,
            "/v1/completions",
            {"prompt": "hello", "max_tokens": 3, "priority": -7, "timeout": 30, "user": "acme"},
        )
        assert status == 200, body
        params = server.engine.seen[-1]
        assert (params.priority, params.timeout, params.tenant) == (-7, 30.0, "acme")
        assert server.engine.stats()["tenants"]["acme"]["requests"] == 1
        status, body = await post(
            session, server, "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": "high"},
        )  # fmt: skip
        assert status == 400 and body["error"]["param"] == "priority"
        status, body = await post(session, server, "/v1/completions", {"prompt": "x", "timeout": 0})
        assert status == 400 and body["error"]["param"] == "timeout"


async def test_generate_takes_priority_at_the_top_or_in_sampling_params(
    server: RunningServer,
) -> None:
    async with aiohttp.ClientSession(headers=auth()) as session:
        for body in (
            {"text": "ab", "priority": 3, "sampling_params": {"max_new_tokens": 2}},
            {"text": "ab", "sampling_params": {"max_new_tokens": 2, "priority": 3}},
        ):
            status, out = await post(session, server, "/generate", body)
            assert status == 200, out
            assert server.engine.seen[-1].priority == 3
        status, out = await post(
            session,
            server,
            "/generate",
            {"text": "ab", "priority": 1, "sampling_params": {"priority": 2}, "user": "t1"},
        )
        assert status == 400 and "given twice" in out["error"]["message"]


async def test_a_request_that_times_out_before_its_first_token_gets_408(
    server: RunningServer,
) -> None:
    eng = server.engine
    async with aiohttp.ClientSession(headers=auth()) as session:
        blocker = asyncio.create_task(
            post(session, server, "/v1/completions", {"prompt": "blocker", "max_tokens": 120})
        )
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.002)
        status, body = await post(
            session, server, "/v1/completions", {"prompt": "late", "max_tokens": 5, "timeout": 0.01}
        )
        assert status == 408, body
        assert (
            body["error"]["code"] == "request_timeout" and "timed out" in body["error"]["message"]
        )
        status, body = await post(
            session, server, "/generate",
            {"text": "late", "sampling_params": {"max_new_tokens": 5, "timeout": 0.01}},
        )  # fmt: skip
        assert status == 408, body
        # streamed: the stream ends with the finish reason, as any other
        async with session.post(
            server.base_url + "/v1/completions",
            json={"prompt": "late", "max_tokens": 5, "timeout": 0.01, "stream": True},
        ) as resp:
            assert resp.status == 200
            chunks = sse_json(await resp.read())
        assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"
        status, _ = await blocker
        assert status == 200
    while eng.stats()["waiting"] or eng.stats()["running"]:
        await asyncio.sleep(0.005)
    assert_no_leak(eng)
    # the 408 and the stream that ended with "timeout"
    assert (
        server.metrics.counter_value(
            "asyncengine_requests_total", {"endpoint": "completions", "outcome": "timeout"}
        )
        == 2
    )


async def test_the_admin_endpoint_swaps_the_policy_behind_its_own_token(
    server: RunningServer,
) -> None:
    body = {"policy": "priority+dynamic-chunking", "options": {"priority": {"preempt": True}}}
    async with aiohttp.ClientSession() as session:
        status, out = await post(session, server, "/admin/policy", body)
        assert status == 401 and out["error"]["code"] == "missing_admin_token"
        status, out = await post(session, server, "/admin/policy", body, headers=auth(API_KEY))
        assert status == 403 and out["error"]["code"] == "invalid_admin_token"
        status, out = await post(session, server, "/admin/policy", body, headers=auth(ADMIN))
        assert status == 200, out
        assert out == {**body, "previous": "fcfs"}
        status, out = await post(
            session, server, "/admin/policy", {"policy": "bogus"}, headers=auth(ADMIN)
        )
        assert status == 400 and "'bogus' is unknown" in out["error"]["message"]
        status, out = await post(
            session, server, "/admin/policy", {"policy": "fair", "oops": 1}, headers=auth(ADMIN)
        )
        assert status == 400
        status, out = await post(
            session, server, "/admin/policy", {"policy": "lpm+"}, headers=auth(ADMIN)
        )
        assert status == 400 and "empty part" in out["error"]["message"]
        # a swap replacing one still pending (idle engine) names the pending one as previous
        status, out = await post(
            session, server, "/admin/policy", {"policy": "lpm"}, headers=auth(ADMIN)
        )
        assert status == 200 and out["previous"] == "priority+dynamic-chunking"
        status, out = await post(session, server, "/admin/policy", body, headers=auth(ADMIN))
        assert status == 200 and out["previous"] == "lpm"
        # the swap happens at the next step
        status, _ = await post(
            session, server, "/generate", {"text": "go", "sampling_params": {"max_new_tokens": 2}},
            headers=auth(),
        )  # fmt: skip
        assert status == 200
        async with session.get(server.base_url + "/admin/policy", headers=auth(ADMIN)) as resp:
            current = await resp.json()
        assert current["policy"] == "priority+dynamic-chunking" and current["policy_swaps"] == 3
        assert server.engine.stats()["policy"] == "priority+dynamic-chunking"
        async with session.get(server.base_url + "/admin/policy") as resp:
            assert resp.status == 401


class FailsToOrder(Policy):
    name = "fails-to-order"

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        raise RuntimeError("boom")


async def test_after_a_policy_fails_the_admin_endpoint_shows_fcfs_in_charge() -> None:
    """A swapped-in policy that fails hands over to FCFS: GET /admin/policy says so (not the
    failed policy), with the failure counted there and in /metrics; the request is served."""
    eng = engine(allowed_policies=[f"{HERE}:FailsToOrder"])
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession(headers=auth(ADMIN)) as session:
            status, out = await post(
                session, running, "/admin/policy", {"policy": "fails-to-order"}
            )
            assert status == 200 and out["previous"] == "fcfs", out
            body = {"text": "go", "sampling_params": {"max_new_tokens": 3}}
            status, out = await post(session, running, "/generate", body)
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
            async with session.get(running.base_url + "/admin/policy") as resp:
                current = await resp.json()
            async with session.get(running.base_url + "/metrics") as resp:
                text = await resp.text()
        assert current["policy"] == "fcfs" and current["options"] == {}, current
        assert current["policy_failures"] == 1 and eng.stats()["policy"] == "fcfs"
        assert "asyncengine_policy_failures_total 1.0" in text
    finally:
        await running.stop()


async def test_without_an_admin_token_there_is_no_admin_endpoint() -> None:
    eng = engine()
    await eng.start()
    running = await start_server(eng.config, engine=eng)
    try:
        async with aiohttp.ClientSession() as session:
            status, out = await post(
                session, running, "/admin/policy", {"policy": "lpm"}, headers=auth(ADMIN)
            )
            assert status == 404
        assert eng.config.policy == "fcfs"
    finally:
        await running.stop()


async def test_scheduler_counters_are_prometheus_series(server: RunningServer) -> None:
    eng = server.engine
    async with aiohttp.ClientSession(headers=auth()) as session:
        tasks = [
            post(session, server, "/v1/completions",
                 {"prompt": f"p{k}", "max_tokens": 6, "user": "t" + str(k % 2)})
            for k in range(5)
        ]  # fmt: skip
        assert all(status == 200 for status, _ in await asyncio.gather(*tasks))
        async with session.get(server.base_url + "/metrics") as resp:
            text = await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    blocked = eng.stats()["admission_blocked"]
    assert blocked["running_cap"] > 0  # one request runs at a time: the others wait
    for reason, count in blocked.items():
        key = ("asyncengine_admission_blocked_total", (("reason", reason),))
        assert samples[key] == count
    for tenant in ("t0", "t1"):  # hashed: a scrape does not list the clients' names
        key = ("asyncengine_tenant_requests_total", (("tenant", tenant_label(tenant)),))
        assert samples[key] == eng.stats()["tenants"][tenant]["requests"]
        assert f'tenant="{tenant}"' not in text
    assert samples[("asyncengine_preemptions_total", ())] == 0
    assert ("asyncengine_request_timeouts_total", ()) in samples
    stats = eng.stats()  # fcfs never holds the engine idle
    assert samples[("asyncengine_policy_idle_holds_total", ())] == stats["policy_idle_holds"] == 0
    assert samples[("asyncengine_policy_idle_seconds_total", ())] == 0.0
