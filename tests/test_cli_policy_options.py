"""--policy-options (and --eviction-policy-options) give a policy its options as the config's
tables do; a bad value is a clear error before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from asyncengine.cli import add_engine_arguments, engine_config_from_args, main


def config_of(*argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flags_give_the_options_a_config_table_gives(tmp_path: Path) -> None:
    config = config_of("--policy", "lpm", "--policy-options", '{"aging": 0.25}')
    assert config.policy_options == {"aging": 0.25}
    composed = config_of(
        "--policy", "lpm+token-budget", "--policy-options", '{"lpm": {"aging": 0.25}}'
    )
    assert composed.policy_options == {"lpm": {"aging": 0.25}}
    rule = config_of("--eviction-policy", "arc", "--eviction-policy-options", '{"step": 8.0}')
    assert rule.eviction_policy_options == {"step": 8.0}
    toml = tmp_path / "c.toml"
    toml.write_text('policy = "lpm"\n[policy_options]\naging = 1.0\n')
    # the flag overrides the file's table, as every flag overrides its key
    assert config_of(
        "--config", str(toml), "--policy-options", '{"aging": 0.5}'
    ).policy_options == {"aging": 0.5}


@pytest.mark.parametrize("value", ["aging=0.5", "{aging: 0.5}", "[1, 2]"])
def test_a_value_that_is_no_json_object_is_refused_by_the_parser(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "hello", "--policy", "lpm", "--policy-options", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --policy-options: expected a JSON object" in err and repr(value) in err


def test_an_option_the_policy_does_not_take_is_named_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["generate", "hello", "--model", "/no/such/model", "--policy", "lpm",
         "--policy-options", '{"agin": 1}']
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "config key 'policy_options'" in err and "'agin'" in err and "aging" in err
