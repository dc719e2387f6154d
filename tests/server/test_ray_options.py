"""``asyncengine serve --replicas``: a bad replica option is refused before Ray starts."""

from __future__ import annotations

import pytest

from asyncengine.cli import build_parser
from asyncengine.server.ray_serve.serve import ray_options


def test_zero_replicas_is_refused() -> None:
    args = build_parser().parse_args(["serve", "--replicas", "0"])
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ray_options(args)


def test_a_cluster_address_alone_deploys_one_replica() -> None:
    args = build_parser().parse_args(["serve", "--ray-address", "10.0.0.1:6379"])
    assert ray_options(args).replicas == 1
