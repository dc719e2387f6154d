"""Plug-ins by name, one loader for every kind (policies, length predictors): a built-in name,
"package.module:Class" (an importable module) or "path/to/file.py:Class" (a file anywhere, no
PYTHONPATH needed)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from asyncengine.common.plugin_spec import file_part

T = TypeVar("T")

# the largest integer a JSON number (a double) holds exactly: an option's integers stay within
# it, so that a rule or policy mixing them with floats never meets one too large to convert
MAX_OPTION_INTEGER = 2**53


def load_file(path: str) -> ModuleType:
    """The module in the Python file ``path`` (loaded once per resolved path)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no such file: {file}")
    name = "asyncengine_user_policy_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _defined(module: ModuleType, base: type, kind: str) -> str:
    """The subclasses of ``base`` that ``module`` defines, for a message naming one it lacks."""
    found = [
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, base)
        and value.__module__ == module.__name__
    ]
    return f"its {kind} classes: {', '.join(found)}" if found else f"it defines no {kind} class"


def resolve_plugin(spec: str, base: type[T], builtins: Mapping[str, type[T]], kind: str) -> type[T]:
    """The class ``spec`` names: a subclass of ``base``; ValueError saying what is wrong, with
    ``kind`` ("policy", "length predictor") in the message."""
    if ":" in spec:
        module_name, _, class_name = spec.rpartition(":")
        path = file_part(spec)
        try:
            module = load_file(path) if path else importlib.import_module(module_name)
        except (ImportError, AttributeError, SyntaxError) as exc:  # raised by the import
            raise ValueError(f"cannot load {kind} {spec!r}: {exc}") from None
        cls = getattr(module, class_name, None)
        if cls is None:
            where = path or module_name
            raise ValueError(
                f"cannot load {kind} {spec!r}: {where} defines no {class_name!r} "
                f"({_defined(module, base, kind)})"
            )
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(
                f"{kind} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}"
            )
        return cls
    key = spec.strip().lower().replace("_", "-")
    if key not in builtins:
        raise ValueError(
            f"unknown {kind} {spec!r}; known: {', '.join(sorted(builtins))}, "
            "'package.module:Class' or 'path/to/file.py:Class'"
        )
    return builtins[key]


def build_plugin(
    cls: type[T], name: str, options: Mapping[str, Any], builtins: Mapping[str, type[T]], kind: str
) -> T:
    """``cls(**options)``; any exception from a plug-in's constructor comes back as a
    ValueError that names the ``kind`` and ``name`` (a built-in's own messages name it and the
    option already, and anything else a built-in raises is a bug of ours, left to propagate):
    a live swap answers it as a bad request and keeps what runs. A NaN, an infinity or an
    integer past ``MAX_OPTION_INTEGER`` anywhere in ``options`` is a ValueError before any
    constructor runs: the step that first used one would fail instead."""
    for key, value in options.items():
        bad = _unsafe_number(value)
        if bad is not None:
            raise ValueError(
                f"{kind} {name!r}: option {key!r} must hold finite numbers, integers of "
                f"magnitude at most 2**53; got {bad}"
            )
    try:
        return cls(**options)
    except Exception as exc:
        if builtins.get(getattr(cls, "name", "")) is cls:
            raise
        given = f"options {dict(options)!r}" if options else "no options"
        raise ValueError(
            f"{kind} {name!r} (class {cls.__name__}) failed to build with {given}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def failed_build_key(key: str, spec: str, options: Mapping[str, Any] | None) -> str:
    """The config key to blame when ``spec`` failed to build: with no options given the plug-in
    itself failed (``key``), else its options (``key + "_options"``), with the value given."""
    return f"{key!r} = {spec!r}" if not options else f"'{key}_options' = {dict(options)!r}"


def _unsafe_number(value: object) -> str | None:
    """What in ``value`` (an option: a number, or lists and tables of them) is not a finite
    number within ``MAX_OPTION_INTEGER``, in words; None when nothing is."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return (
            None if abs(value) <= MAX_OPTION_INTEGER else f"an integer of {value.bit_length()} bits"
        )
    if isinstance(value, float):
        return None if math.isfinite(value) else repr(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        bad = _unsafe_number(item)
        if bad is not None:
            return bad
    return None
