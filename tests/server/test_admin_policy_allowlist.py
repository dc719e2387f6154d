"""POST /admin/policy never loads code a request names: a policy file or module path in the body
is a 400 naming what is allowed (built-ins, their compositions, the start-up list), and the file
never runs; a plugin listed at start-up (``allowed_policies`` / ``--allow-policy``) loads then
and swaps in live."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from asyncengine.cli import engine_config_from_args
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import make_policies
from asyncengine.policies.registry import check_live_policy
from tests.api.test_scheduling_e2e import engine
from tests.server.test_server_scheduling import ADMIN, auth, post
from tests.server_support import start_server

PLUGIN = """
from pathlib import Path
from asyncengine.policies.fcfs import FCFSPolicy

Path({marker!r}).write_text("ran")


class Mine(FCFSPolicy):
    name = "mine"
"""


def plugin(tmp_path: Path, name: str) -> tuple[Path, Path]:
    marker = tmp_path / f"{name}.marker"
    file = tmp_path / f"{name}.py"
    file.write_text(PLUGIN.format(marker=str(marker)))
    return file, marker


async def test_a_policy_file_named_by_a_request_is_refused_and_never_runs(tmp_path: Path) -> None:
    file, marker = plugin(tmp_path, "attack")
    library = tmp_path / "attack.so"
    library.write_bytes(b"\x7fELF not really")
    eng = engine(policy="fcfs")
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession() as session:
            for spec in (
                f"{file}:Mine",
                f"lpm+{file}:Mine",
                f"{library}:Mine",
                "os:system",
                "asyncengine.policies.fcfs:FCFSPolicy",
            ):
                status, out = await post(
                    session, running, "/admin/policy", {"policy": spec}, headers=auth(ADMIN)
                )
                assert status == 400, (spec, out)
                message = out["error"]["message"]
                assert "a live swap takes built-in names" in message and "lpm" in message
                assert "--allow-policy" in message
            status, out = await post(
                session, running, "/admin/policy", {"policy": "lpm"}, headers=auth(ADMIN)
            )
            assert status == 200 and out["previous"] == "fcfs"
        assert not marker.exists()
        assert eng.config.policy == "lpm"
    finally:
        await running.stop()


async def test_a_plugin_listed_at_start_up_loads_then_and_swaps_in_live(tmp_path: Path) -> None:
    file, marker = plugin(tmp_path, "listed")
    other, other_marker = plugin(tmp_path, "unlisted")
    eng = engine(policy="fcfs", allowed_policies=[f"{file}:Mine"])
    await eng.start()
    assert marker.exists()  # loaded at start-up, before any request
    marker.unlink()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession() as session:
            status, out = await post(
                session, running, "/admin/policy", {"policy": f"{other}:Mine"}, headers=auth(ADMIN)
            )
            assert status == 400 and f"{file}:Mine" in out["error"]["message"]
            status, out = await post(
                session, running, "/admin/policy", {"policy": f"{file}:Mine"}, headers=auth(ADMIN)
            )
            assert status == 200, out
        assert eng.config.policy == f"{file}:Mine"
        assert not marker.exists() and not other_marker.exists()  # not loaded again, nor the other
    finally:
        await running.stop()


BROKEN = {
    "policy": """
from asyncengine.policies.fcfs import FCFSPolicy


class Broken(FCFSPolicy):
    name = "broken"

    def __init__(self, **options):
        raise {error}("no tables to read")
""",
    "eviction-policy": """
from asyncengine.cache.eviction_rule import EvictionRule


class Broken(EvictionRule):
    def __init__(self, **options):
        raise {error}("no tables to read")

    def key(self, node):
        return 0.0
""",
}


@pytest.mark.parametrize("error", ["RuntimeError", "KeyError", "ZeroDivisionError"])
@pytest.mark.parametrize("what", ["policy", "eviction-policy"])
async def test_a_listed_plugin_whose_constructor_raises_is_a_400_and_what_runs_stays(
    tmp_path: Path, what: str, error: str
) -> None:
    """Policies and eviction rules alike: the error names the plug-in and its own words, and
    the running policy or rule goes on."""
    file = tmp_path / "broken.py"
    file.write_text(BROKEN[what].format(error=error))
    listed = f"{file}:Broken"
    lists = "allowed_policies" if what == "policy" else "allowed_eviction_policies"
    eng = engine(policy="fcfs", eviction_policy="lfu", **{lists: [listed]})
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    swap = eng.set_policy if what == "policy" else eng.set_eviction_policy
    before = {key: eng.stats()[key] for key in ("policy", "eviction_policy")}
    try:
        async with aiohttp.ClientSession() as session:
            for name in (listed, "broken" if what == "policy" else "Broken"):
                status, out = await post(
                    session, running, f"/admin/{what}", {"policy": name}, headers=auth(ADMIN)
                )
                assert status == 400, out
                message = out["error"]["message"]
                assert listed in message and "(class Broken)" in message
                assert error in message and "no tables to read" in message
                assert out["error"]["code"] == f"invalid_{what.replace('-', '_')}"
        with pytest.raises(ConfigError, match=f"class Broken.*{error}"):
            swap(listed)
        assert (eng.config.policy, eng.config.eviction_policy) == ("fcfs", "lfu")
        await eng.generate("hello", SamplingParams(max_new_tokens=2, temperature=0))
        # the running policy and rule stay in place
        assert {key: eng.stats()[key] for key in before} == before
    finally:
        await running.stop()


RULE = """
from asyncengine.cache.eviction_rule import EvictionRule


class Deepest(EvictionRule):
    def key(self, node):
        return -float(node.prefix_len)
"""


async def test_the_start_up_policy_and_rule_swap_back_in_by_spec_or_name(tmp_path: Path) -> None:
    file, _ = plugin(tmp_path, "start")
    rule = tmp_path / "deepest.py"
    rule.write_text(RULE)
    eng = engine(policy=f"{file}:Mine", eviction_policy=f"{rule}:Deepest")  # nothing listed
    await eng.start()
    running = await start_server(eng.config, engine=eng, admin_token=ADMIN)
    try:
        async with aiohttp.ClientSession() as session:

            async def swap(path: str, spec: str) -> dict[str, str]:
                status, out = await post(
                    session, running, path, {"policy": spec}, headers=auth(ADMIN)
                )
                assert status == 200, (spec, out)
                return out  # type: ignore[no-any-return]

            assert (await swap("/admin/policy", "lpm"))["previous"] == f"{file}:Mine"
            back = await swap("/admin/policy", "mine")  # its class's name
            assert back == {"policy": f"{file}:Mine", "options": {}, "previous": "lpm"}
            await swap("/admin/policy", "fcfs")
            await swap("/admin/policy", "mine+token-budget")
            assert eng.config.policy == f"{file}:Mine+token-budget"
            await swap("/admin/policy", f"{file}:Mine")  # by the spec it started with
            assert eng.config.policy == f"{file}:Mine"
            assert (await swap("/admin/eviction-policy", "lru"))["previous"] == "Deepest"
            back = await swap("/admin/eviction-policy", "Deepest")
            assert back["policy"] == f"{rule}:Deepest"
        assert eng.stats()["eviction_policy"] == "Deepest"
        await eng.generate("hello", SamplingParams(max_new_tokens=2, temperature=0))
        assert eng.stats()["policy"] == "mine"  # it runs again
    finally:
        await running.stop()


def test_the_live_check_takes_built_ins_compositions_and_the_list() -> None:
    check_live_policy("LPM+dynamic_chunking", [])
    check_live_policy("x.py:A+token-budget", ["x.py:A"])
    check_live_policy("pkg.mod:B", ["pkg.mod:B"])
    with pytest.raises(ValueError, match="may not be swapped in live"):
        check_live_policy("pkg.mod:B", ["x.py:A"])
    with pytest.raises(ValueError, match="'bogus' is unknown"):
        check_live_policy("bogus", [])


def test_a_refused_swap_names_each_listed_plugin_by_the_name_it_swaps_in_by(
    tmp_path: Path,
) -> None:
    file, _ = plugin(tmp_path, "listed")
    listed = re.escape(f"listed at start-up: {file}:Mine (as 'mine'), lpm;")
    with pytest.raises(ValueError, match=listed):
        check_live_policy("my-policy", [f"{file}:Mine", "lpm"])
    assert check_live_policy("mine", [f"{file}:Mine", "lpm"]) == f"{file}:Mine"


def test_the_start_up_list_comes_from_the_cli_and_toml_and_is_checked(tmp_path: Path) -> None:
    import argparse

    from asyncengine.cli import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--allow-policy", "a.py:A", "--allow-policy", "lpm"])
    assert engine_config_from_args(args).allowed_policies == ["a.py:A", "lpm"]
    toml = tmp_path / "c.toml"
    toml.write_text('allowed_policies = ["sjf"]\n')
    assert EngineConfig.from_toml(toml).allowed_policies == ["sjf"]
    with pytest.raises(ConfigError, match="allowed_policies"):
        make_policies(EngineConfig(allowed_policies=[str(tmp_path / "missing.py") + ":X"]))
