"""EngineConfig from TOML with overrides; every shipped config loads and builds its policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncengine.config import ConfigError, EngineConfig
from asyncengine.policies import make_policy

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load(path: Path) -> None:
    config = EngineConfig.from_toml(path)
    policy = make_policy(config.policy, config.policy_options)
    assert policy.name == config.policy


def test_overrides_win_and_none_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('policy = "lpm"\npage_size = 8\n')
    config = EngineConfig.from_toml(path, page_size=None, policy="fcfs")
    assert config.policy == "fcfs" and config.page_size == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pagesize = 3", "pagesize"),
        ('page_size = "big"', "page_size"),
        ("page_size = 0", "page_size"),
        ('dtype = "int8"', "dtype"),
        ("chunked_prefill_size = 3", "chunked_prefill_size"),
        ("[engine]\nmodel = 'x'\n[other]\na = 1", "other"),
        ("this is not toml", "not valid TOML"),
        ('policy = "nope"', "config key 'policy' = 'nope': unknown policy"),
        ('policy = "lpm+fcfs"', "config key 'policy'.*more than one ordering"),
        ('policy = "lpm"\n[policy_options]\nagin = 1', "config key 'policy_options'.*'agin'"),
        (
            'policy = "dynamic-chunking"\n[policy_options]\nsmoothing = 2.0',
            "config key 'policy_options'.*smoothing",
        ),
    ],
)
def test_bad_keys_and_values_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_toml(path)


def test_unknown_policy_and_option_are_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="aging"):
        make_policy("lpm", {"agin": 1.0})
    with pytest.raises(ValueError, match="more than one ordering"):
        make_policy("lpm+fcfs")


def test_user_policy_by_import_path() -> None:
    policy = make_policy("asyncengine.policies.fcfs:FCFSPolicy")
    assert policy.name == "fcfs"


def test_a_bad_policy_fails_when_the_config_is_built_not_at_engine_start() -> None:
    with pytest.raises(ConfigError, match="config key 'policy' = 'lpm-typo'"):
        EngineConfig(policy="lpm-typo")
    with pytest.raises(ConfigError, match="config key 'policy_options'"):
        EngineConfig(policy="token-budget", policy_options={"prefill_tokens": 0})
    with pytest.raises(ConfigError, match="cannot load policy 'no_such_pkg.mod:Policy'"):
        EngineConfig.from_toml(None, policy="no_such_pkg.mod:Policy")
    config = EngineConfig(policy="lpm+dynamic-chunking", policy_options={"lpm": {"aging": 0.5}})
    with pytest.raises(ConfigError, match="policy_options"):
        config.replace(policy_options={"lpm": {"aging": -1.0}})
