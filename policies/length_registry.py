"""Length predictors by name: built-ins, "package.module:Class" or "path/to/file.py:Class",
loaded as policies are (policies/registry.py)."""

from __future__ import annotations

from typing import Any

from asyncengine.common.config import ConfigError
from asyncengine.policies.length_history import HistoryPredictor
from asyncengine.policies.length_predictor import (
    LengthPredictor,
    MaxTokensPredictor,
    OraclePredictor,
)
from asyncengine.policies.length_ranker import RankerPredictor
from asyncengine.policies.plugin_loader import build_plugin, failed_build_key, resolve_plugin

PREDICTORS: dict[str, type[LengthPredictor]] = {
    cls.name: cls
    for cls in (MaxTokensPredictor, OraclePredictor, HistoryPredictor, RankerPredictor)
}


def resolve_length_predictor(spec: str) -> type[LengthPredictor]:
    return resolve_plugin(spec, LengthPredictor, PREDICTORS, "length predictor")


def build_length_predictor(spec: str, options: dict[str, Any] | None = None) -> LengthPredictor:
    """The predictor ``spec`` names, built with ``options``; ConfigError naming the config key."""
    try:
        cls = resolve_length_predictor(spec)
    except ValueError as exc:
        raise ConfigError(f"config key 'length_predictor' = {spec!r}: {exc}") from None
    try:
        return build_plugin(cls, spec, options or {}, PREDICTORS, "length predictor")
    except (TypeError, ValueError) as exc:
        where = failed_build_key("length_predictor", spec, options)
        raise ConfigError(f"config key {where}: {exc}") from None
