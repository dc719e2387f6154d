"""Length predictors by name: built-ins, "package.module:Class" or "path/to/file.py:Class",
loaded as policies are (policies/registry.py)."""

from __future__ import annotations

import importlib
from typing import Any

from asyncengine.config import ConfigError
from asyncengine.policies.length_history import HistoryPredictor
from asyncengine.policies.length_predictor import (
    LengthPredictor,
    MaxTokensPredictor,
    OraclePredictor,
)
from asyncengine.policies.length_ranker import RankerPredictor
from asyncengine.policies.registry import load_file

PREDICTORS: dict[str, type[LengthPredictor]] = {
    cls.name: cls
    for cls in (MaxTokensPredictor, OraclePredictor, HistoryPredictor, RankerPredictor)
}


def resolve_length_predictor(spec: str) -> type[LengthPredictor]:
    if ":" in spec:
        module_name, _, class_name = spec.rpartition(":")
        from_file = module_name.endswith(".py") or "/" in module_name
        try:
            module = load_file(module_name) if from_file else importlib.import_module(module_name)
            cls = getattr(module, class_name)
        except (ImportError, AttributeError, SyntaxError) as exc:
            raise ValueError(f"cannot load length predictor {spec!r}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, LengthPredictor)):
            raise ValueError(
                f"length predictor {spec!r} is not a subclass of "
                "asyncengine.policies.length_predictor.LengthPredictor"
            )
        return cls
    key = spec.strip().lower().replace("_", "-")
    if key not in PREDICTORS:
        raise ValueError(
            f"unknown length predictor {spec!r}; known: {', '.join(sorted(PREDICTORS))}, "
            "'package.module:Class' or 'path/to/file.py:Class'"
        )
    return PREDICTORS[key]


def build_length_predictor(spec: str, options: dict[str, Any] | None = None) -> LengthPredictor:
    """The predictor ``spec`` names, built with ``options``; ConfigError naming the config key."""
    try:
        cls = resolve_length_predictor(spec)
    except ValueError as exc:
        raise ConfigError(f"config key 'length_predictor' = {spec!r}: {exc}") from None
    try:
        return cls(**(options or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config key 'length_predictor_options' = {options!r}: {exc}") from None
