"""A live swap's options hold only numbers the policies can compute with: an integer too large
for a float (JSON has no bound on one; a rule that took it would fail the engine loop at its
next use of the cache) is a 400 naming the option, and the policy and rule that run stay and
keep serving. NaN and infinities (a TOML config can hold them) are refused at start-up alike."""

from __future__ import annotations

import aiohttp
import pytest

from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import make_policies
from asyncengine.policies.eviction_registry import build_eviction_rule
from tests.api.test_scheduling_e2e import engine
from tests.server.test_server_scheduling import ADMIN, auth, post
from tests.server_support import start_server

HUGE = 10**400  # decodes from JSON as a Python int


@pytest.mark.parametrize(
    ("path", "change"),
    [
        ("/admin/eviction-policy", {"policy": "arc", "options": {"bonus": HUGE}}),
        ("/admin/eviction-policy", {"policy": "arc", "options": {"ghost_pages": -HUGE}}),
        ("/admin/policy", {"policy": "lpm", "options": {"aging": HUGE}}),
        ("/admin/policy", {"policy": "lpm+token-budget", "options": {"lpm": {"aging": HUGE}}}),
    ],
)
async def test_an_integer_too_large_for_a_float_is_a_400_and_what_runs_stays(
    path: str, change: dict[str, object]
) -> None:
    eng = engine(policy="fcfs", eviction_policy="lru")
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession() as session:
            status, out = await post(session, running, path, change, headers=auth(ADMIN))
        assert status == 400, out
        assert "must hold finite numbers" in out["error"]["message"]
        assert "1329 bits" in out["error"]["message"]
        for _ in range(2):  # a cache hit the second time: the rule is used
            await eng.generate("hello, the same prompt", SamplingParams(max_new_tokens=2))
        assert eng.is_running
        assert (eng.stats()["policy"], eng.stats()["eviction_policy"]) == ("fcfs", "lru")
    finally:
        await running.stop()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), [1.0, float("nan")]])
def test_nan_and_infinities_in_options_are_config_errors(value: object) -> None:
    with pytest.raises(ConfigError, match="'bonus' must hold finite numbers"):
        build_eviction_rule("arc", {"bonus": value})
    with pytest.raises(ConfigError, match="'aging' must hold finite numbers"):
        make_policies(EngineConfig(policy="lpm", policy_options={"aging": value}))


def test_numbers_a_double_holds_exactly_are_taken() -> None:
    exact = build_eviction_rule("arc", {"bonus": 2**53, "max_bonus": 2**53})
    assert exact.bonus == 2**53  # type: ignore[attr-defined]
    make_policies(
        EngineConfig(policy="lpm", policy_options={"aging": 2.5, "max_wait_tokens": 2**53})
    )
