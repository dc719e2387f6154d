"""EngineConfig from TOML with overrides; every shipped config loads and builds its policy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncengine import AsyncEngine, ConfigError
from asyncengine.common.config import EngineConfig
from asyncengine.core.builder import make_policies
from asyncengine.policies import make_policy
from asyncengine.policies.registry import BUILTIN
from tests.fake_executor import fake_core

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load(path: Path) -> None:
    config = EngineConfig.from_toml(path)
    policy = make_policy(config.policy, config.policy_options)
    assert policy.name == config.policy


def test_every_builtin_policy_has_a_config() -> None:
    # the README and policies.md promise a commented TOML file per built-in policy
    shipped = {path.stem for path in CONFIGS}
    assert sorted(set(BUILTIN) - shipped) == []


def test_overrides_win_and_none_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('policy = "lpm"\npage_size = 8\n')
    config = EngineConfig.from_toml(path, page_size=None, policy="fcfs")
    assert config.policy == "fcfs" and config.page_size == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pagesize = 3", "unknown config key 'pagesize' \\(did you mean 'page_size'\\?\\)"),
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
        make_policies(EngineConfig.from_toml(path))  # policies are checked where they are built


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_running_requests": "3"}, "config key 'max_running_requests' = '3': Expected `int`"),
        ({"loras": {"a": 5}}, "config key 'loras'.*Expected `str`"),
        ({"enable_prefix_cache": "no"}, "config key 'enable_prefix_cache'.*Expected `bool`"),
    ],
)
def test_a_config_built_directly_names_a_value_of_the_wrong_type(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**values)  # type: ignore[arg-type]


def test_paths_may_be_given_as_path_objects(tmp_path: Path) -> None:
    config = EngineConfig(model=tmp_path / "m", loras={"a": tmp_path / "a"})  # type: ignore[arg-type]
    assert config.model == str(tmp_path / "m") and config.loras == {"a": str(tmp_path / "a")}
    assert EngineConfig.from_dict(config.to_dict()) == config


def test_a_mistake_in_the_file_names_the_file_and_one_in_the_overrides_does_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.toml"
    path.write_text("page_size = 0\n")
    for overrides in ({}, {"policy": "lpm"}):
        with pytest.raises(
            ConfigError, match=f"^config file {re.escape(str(path))}: .*'page_size'"
        ):
            EngineConfig.from_toml(path, **overrides)
    path.write_text("page_size = 8\n")
    with pytest.raises(
        ConfigError, match="^(bad engine config: )?config key 'max_running_requests'"
    ):
        EngineConfig.from_toml(path, max_running_requests=0)


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


def test_a_bad_policy_fails_when_the_engine_is_made_before_the_model_loads() -> None:
    with pytest.raises(ConfigError, match="config key 'policy' = 'lpm-typo'"):
        AsyncEngine(EngineConfig(policy="lpm-typo"))  # __init__ loads nothing
    with pytest.raises(ConfigError, match="config key 'policy_options'"):
        make_policies(EngineConfig(policy="token-budget", policy_options={"prefill_tokens": 0}))
    with pytest.raises(ConfigError, match="cannot load policy 'no_such_pkg.mod:Policy'"):
        make_policies(EngineConfig.from_toml(None, policy="no_such_pkg.mod:Policy"))
    with pytest.raises(ConfigError, match="config key 'shadow_policy' = 'nope'"):
        make_policies(EngineConfig(shadow_policy="nope"))
    with pytest.raises(ConfigError, match="shadow_policy_options"):
        EngineConfig(shadow_policy_options={"aging": 1.0})
    config = EngineConfig(policy="lpm+dynamic-chunking", policy_options={"lpm": {"aging": 0.5}})
    with pytest.raises(ConfigError, match="policy_options"):
        make_policies(config.replace(policy_options={"lpm": {"aging": -1.0}}))


def test_a_policy_loads_from_a_file_path(tmp_path: Path) -> None:
    source = tmp_path / "my_policy.py"
    source.write_text(
        "from asyncengine.policies.fcfs import FCFSPolicy\n\n"
        "class Newest(FCFSPolicy):\n"
        "    name = 'newest'\n\n"
        "    def order(self, waiting, ctx):\n"
        "        return waiting[::-1]\n"
    )
    policy, _ = make_policies(EngineConfig(policy=f"{source}:Newest"))
    assert policy.name == "newest"
    with pytest.raises(ConfigError, match="cannot load policy"):
        make_policies(EngineConfig(policy=f"{tmp_path / 'absent.py'}:Newest"))
    # a misspelt class is named with the ones the file defines (not those it imports)
    with pytest.raises(ConfigError, match=r"defines no 'Absent' \(its policy classes: Newest\)"):
        make_policies(EngineConfig(policy=f"{source}:Absent"))


def test_a_plugin_policys_own_error_is_named_with_the_policy(tmp_path: Path) -> None:
    """A policy of one's own that refuses to build says so in its own words, naming itself;
    the options are blamed only when some were given."""
    source = tmp_path / "strict.py"
    source.write_text(
        "from asyncengine.policies.fcfs import FCFSPolicy\n\n"
        "class Strict(FCFSPolicy):\n"
        "    def __init__(self, weight: float = -1.0) -> None:\n"
        "        super().__init__()\n"
        "        if weight <= 0:\n"
        "            raise ValueError(f'weight must be positive, got {weight}')\n"
    )
    spec = f"{source}:Strict"
    alone = re.escape(
        f"config key 'policy' = '{spec}': policy '{spec}' (class Strict) failed to build with "
        "no options: ValueError: weight must be positive, got -1.0"
    )
    with pytest.raises(ConfigError, match=f"^{alone}$"):
        make_policies(EngineConfig(policy=spec))
    given = re.escape(
        f"config key 'policy_options' = {{'weight': 0}}: policy '{spec}' (class Strict) failed "
        "to build with options {'weight': 0}: ValueError: weight must be positive, got 0"
    )
    with pytest.raises(ConfigError, match=f"^{given}$"):
        make_policies(EngineConfig(policy=spec, policy_options={"weight": 0}))
    with pytest.raises(ConfigError, match="'policy_options'.*TypeError.*unexpected keyword"):
        make_policies(EngineConfig(policy=spec, policy_options={"wieght": 1}))
    composed = f"{spec}+token-budget"
    with pytest.raises(ConfigError, match=re.escape(f"policy '{spec}' (class Strict)")):
        make_policies(EngineConfig(policy=composed))
    assert make_policies(EngineConfig(policy=spec, policy_options={"weight": 2}))[0]


def test_kv_blocked_skips_must_not_be_negative() -> None:
    assert EngineConfig(kv_blocked_skips=3).kv_blocked_skips == 3
    with pytest.raises(ConfigError, match="kv_blocked_skips"):
        EngineConfig(kv_blocked_skips=-1)


def test_a_config_files_plugin_paths_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "experiment"
    (folder / "rules").mkdir(parents=True)
    (folder / "newest.py").write_text(
        "from asyncengine.policies.base import Policy\n\n"
        "class Newest(Policy):\n"
        "    orders = True\n\n"
        "    def order(self, waiting, ctx):\n"
        "        return waiting[::-1]\n"
    )
    (folder / "rules" / "oldest.py").write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n\n"
        "class Oldest(EvictionRule):\n"
        "    pass\n"
    )
    path = folder / "run.toml"
    path.write_text(
        'policy = "newest.py:Newest+token-budget"\n'
        'eviction_policy = "rules/oldest.py:Oldest"\n'
        'allowed_policies = ["./newest.py:Newest", "lpm"]\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # started from another folder than the config's
    config = EngineConfig.from_toml(path)
    assert config.policy == f"{folder / 'newest.py'}:Newest+token-budget"
    assert config.allowed_policies == [f"{folder / 'newest.py'}:Newest", "lpm"]
    policy, _ = make_policies(config)
    assert policy.name == "Newest+token-budget"
    assert fake_core(eviction_policy=config.eviction_policy)[0].kv.tree.rule.name == "Oldest"
    # a path on the command line (an override) stays relative to where the command runs
    given = EngineConfig.from_toml(path, policy="newest.py:Newest")
    assert given.policy == "newest.py:Newest"
    with pytest.raises(ConfigError, match="cannot load policy"):
        make_policies(given)


def test_a_config_files_model_and_adapter_paths_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path that says it is one, or names something beside the file, is taken from
    the file's folder; a known model name, an absolute path, and a path found nowhere beside
    the file stay as written (the loader reads them from the working directory)."""
    folder = tmp_path / "experiment"
    (folder / "adapters" / "mine").mkdir(parents=True)
    path = folder / "run.toml"
    path.write_text(
        'model = "./m"\n'
        'speculative = {method = "draft", model = "../draft.gguf"}\n'
        '[loras]\nmine = "adapters/mine"\nelsewhere = "not/here"\nabsolute = "/srv/lora"\n'
    )
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_toml(path)
    assert config.model == str(folder / "m")
    assert config.speculative is not None
    assert config.speculative["model"] == str(tmp_path / "draft.gguf")
    assert config.loras == {
        "mine": str(folder / "adapters" / "mine"),
        "elsewhere": "not/here",
        "absolute": "/srv/lora",
    }
    path.write_text('model = "smollm2-135m"\n')
    assert EngineConfig.from_toml(path).model == "smollm2-135m"
    # on the command line (an override) a path stays relative to where the command runs
    assert EngineConfig.from_toml(path, model="./m").model == "./m"


@pytest.mark.parametrize("name", ["a/b", "", "two\nlines", "x" * 257])
def test_an_adapter_name_no_request_could_select_is_refused(tmp_path: Path, name: str) -> None:
    """A request names an adapter in 256 characters at most, and its key ``name/2`` (a reload)
    must not be another's name; line breaks would split the log lines naming it."""
    with pytest.raises(ConfigError, match="printable characters without '/'"):
        EngineConfig(loras={name: str(tmp_path)})
    EngineConfig(loras={"x" * 256: str(tmp_path), "a b.ü-1": str(tmp_path)})
