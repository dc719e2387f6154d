"""The numbers a JSON schema bounds its values with, checked before xgrammar reads them.

JSON Schema wants ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``minProperties``
and ``maxProperties`` to be non-negative integers, ``multipleOf`` above 0 and the numeric
bounds numbers. xgrammar's converter misreads some values that break these rules (``maxLength:
-1`` and ``minItems: -1`` are taken as no bound, and as ``maxItems: 0``), refuses others in its
own words (``minLength: -1`` with a grammar of its making, ``{-1, -1}``), and refuses bounds
that no value meets (``minimum`` above ``maximum``). ``bounds_problem`` names the first such
keyword, where it is and the rule, so that the request is refused in those words instead:

    bounds_problem({"type": "string", "minLength": -1})
    # "'minLength' at # must be a non-negative integer (at most 2147483647), not -1"

What xgrammar does with each value was found by probing its converter
(tests/structured/test_schema_bounds.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, TypeGuard

from asyncengine.structured.schema_annotations import ONE_SCHEMA, SCHEMA_LISTS, SCHEMA_MAPS

MAX_COUNT = 2**31 - 1  # xgrammar keeps lengths and counts in 32-bit integers
# (lower, upper, the type they bound): counts
COUNTS = (
    ("minLength", "maxLength", "string"),
    ("minItems", "maxItems", "array"),
    ("minProperties", "maxProperties", "object"),
)
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def bounds_problem(schema: Any) -> str | None:
    """The first bound of ``schema`` that breaks its rule, said in a sentence (None: none)."""
    return next(_problems(schema, "#"), None)


def bounds_problem_in_spec(kind: str, spec: str) -> str | None:
    """``bounds_problem`` of a constraint's schema, or of each schema in a structural tag."""
    if kind not in ("json_schema", "structural_tag"):
        return None
    try:
        given = json.loads(spec)
    except ValueError:
        return None  # the compiler says what is wrong with it
    schemas = [given] if kind == "json_schema" else list(_tag_schemas(given))
    return next((p for s in schemas if (p := bounds_problem(s)) is not None), None)


def _tag_schemas(node: Any) -> Iterator[Any]:
    """The JSON schemas a structural tag holds content to."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"]
            return
        for value in node.values():
            yield from _tag_schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _tag_schemas(item)


def _problems(schema: Any, where: str) -> Iterator[str]:
    if not isinstance(schema, dict):
        return
    yield from _checked(schema, where)
    for key, value in schema.items():
        if key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _problems(sub, f"{where}/{key}/{i}")
        elif key in ONE_SCHEMA:
            yield from _problems(value, f"{where}/{key}")
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _problems(sub, f"{where}/{key}/{_escape(name)}")


def _checked(schema: dict[str, Any], where: str) -> Iterator[str]:
    types = _types(schema)
    for low, high, kind in COUNTS:
        for keyword in (low, high):
            value = schema.get(keyword)
            if keyword in schema and not _count(value):
                yield (
                    f"{keyword!r} at {where} must be a non-negative integer (at most "
                    f"{MAX_COUNT}), not {json.dumps(value)}"
                )
        least, most = schema.get(low), schema.get(high)
        if kind in types and _count(least) and _count(most) and least > most:
            yield f"{low!r} {least} at {where} is above its {high!r} {most}: no {kind} matches"
    for keyword in NUMBERS:
        value = schema.get(keyword)
        if keyword in schema and not _number(value):
            draft4 = " (draft 4's true/false form is not read: give the bound itself)"
            yield (
                f"{keyword!r} at {where} must be a number, not {json.dumps(value)}"
                + (draft4 if isinstance(value, bool) and keyword.startswith("exclusive") else "")
            )
    multiple = schema.get("multipleOf")
    if _number(multiple) and multiple <= 0:
        yield f"'multipleOf' at {where} must be greater than 0, not {json.dumps(multiple)}"
    if types & {"integer", "number"}:
        yield from _range(schema, where, integers="number" not in types)


def _range(schema: dict[str, Any], where: str, integers: bool) -> Iterator[str]:
    """Bounds that no number (no integer, for ``type: integer``) lies between."""
    bounds = {k: schema[k] for k in NUMBERS[:4] if k in schema and _number(schema[k])}
    if "integer" in _types(schema):
        for keyword, value in bounds.items():
            if not float(value).is_integer():  # xgrammar's rule: it bounds integers by integers
                yield f"{keyword!r} at {where} must be a whole number with 'type' 'integer'"
                return
    low = _tightest(bounds, ("minimum", "exclusiveMinimum"), max)
    high = _tightest(bounds, ("maximum", "exclusiveMaximum"), min)
    if low is None or high is None:
        return
    (low_key, low_value), (high_key, high_value) = low, high
    if integers:
        first = low_value + (low_key == "exclusiveMinimum")
        last = high_value - (high_key == "exclusiveMaximum")
        empty = first > last
    else:
        exclusive = "exclusive" in low_key + high_key
        empty = low_value > high_value or (low_value == high_value and exclusive)
    if empty:
        kind = "integer" if integers else "number"
        yield (
            f"{low_key!r} {json.dumps(low_value)} and {high_key!r} {json.dumps(high_value)} at "
            f"{where} leave no {kind} between them"
        )


def _tightest(bounds: dict[str, Any], keys: tuple[str, str], pick: Any) -> tuple[str, float] | None:
    """The bound of ``keys`` that binds (``pick``: max for lower bounds, min for upper ones);
    the exclusive one where both are equal."""
    given = [(bounds[k], k) for k in keys if k in bounds]
    if not given:
        return None
    value = pick(v for v, _ in given)
    key = [k for v, k in given if v == value][-1]
    return key, value


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _types(schema: dict[str, Any]) -> set[str]:
    given = schema.get("type")
    if isinstance(given, str):
        return {given}
    return {t for t in given if isinstance(t, str)} if isinstance(given, list) else set()


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
