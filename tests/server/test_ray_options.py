"""``asyncengine serve --replicas``: a bad replica or router option is one error line, before
Ray starts or a model loads."""

from __future__ import annotations

import pytest

from asyncengine.cli import build_parser, main
from asyncengine.server.ray_serve.deployment import RayDeployment
from asyncengine.server.ray_serve.serve import ray_options


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("foo=1", "router 'cache-aware' has no option 'foo' (its options: cache_threshold, "),
        ("cache_threshold=high", "router option cache_threshold must be a number, got 'high'"),
    ],
)
def test_a_bad_router_option_is_one_error_line(
    option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--port", "0", "--replicas", "2", "--router-option", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncengine: error: {message}") and err.count("\n") == 1


def test_zero_replicas_is_refused() -> None:
    args = build_parser().parse_args(["serve", "--replicas", "0"])
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ray_options(args)


def test_a_cluster_address_alone_deploys_one_replica() -> None:
    args = build_parser().parse_args(["serve", "--ray-address", "10.0.0.1:6379"])
    assert ray_options(args).replicas == 1


def test_a_fixed_kv_events_port_for_local_replicas_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each replica would bind the port and all but one fail to start, for ever."""
    monkeypatch.setattr(RayDeployment, "open", lambda self, config: pytest.fail("Ray started"))
    argv = ["serve", "--port", "0", "--replicas", "2", "--kv-events", "tcp://127.0.0.1:5557"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncengine: error: --kv-events tcp://127.0.0.1:5557 would be bound")
    assert err.count("\n") == 1
