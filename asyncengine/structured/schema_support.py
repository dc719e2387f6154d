"""Which JSON-schema keywords the grammar enforces.

xgrammar's JSON-schema converter drops some keywords without a word (``uniqueItems``, ``not``,
``if``, a lookahead in ``pattern``, ``maxLength`` beside ``format``, every keyword beside
``anyOf`` or ``$ref``, ...): a schema that uses one would be accepted and then not held. Where
a schema is a constraint (``response_format``, strict tools, a tool choice that makes the
output calls), ``check_enforced`` refuses it, naming the keyword and where it is:

    check_enforced(schema)   # InvalidRequestError: keyword 'uniqueItems' at #/properties/tags ...

What is refused was found by probing xgrammar's converter with instances that break each
keyword (tests/structured/test_schema_support.py holds the probes). Annotations (description,
title, examples, default, ...) and keywords the JSON-schema specification leaves unknown are
no constraint, so they pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.structured.regex_reading import unreadable_pattern

# constraints xgrammar's converter ignores wherever they stand
IGNORED = {
    "not": "use the types and values that are allowed instead of the one that is not",
    "if": "conditional schemas are not supported",
    "then": "conditional schemas are not supported",
    "else": "conditional schemas are not supported",
    "contains": "list the items' schema in 'items' instead",
    "minContains": "list the items' schema in 'items' instead",
    "maxContains": "list the items' schema in 'items' instead",
    "dependentRequired": "put the properties in 'required' instead",
    "dependentSchemas": "merge the schemas instead",
    "dependencies": "put the properties in 'required' instead",
    "additionalItems": "use 'prefixItems' and 'items' instead",
    "contentEncoding": "the grammar does not decode string contents",
    "contentMediaType": "the grammar does not decode string contents",
    "contentSchema": "the grammar does not decode string contents",
    "$dynamicRef": "use a local '$ref' (#/$defs/...) instead",
    "$recursiveRef": "use a local '$ref' (#/$defs/...) instead",
}
# the "format" values the grammar enforces; xgrammar takes any other string as it is
FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)
# keywords that need their type named in "type" (xgrammar drops them from an untyped schema)
NEEDS_TYPE = {
    "pattern": ("string",),
    "format": ("string",),
    "minLength": ("string",),
    "maxLength": ("string",),
    "minimum": ("integer", "number"),
    "maximum": ("integer", "number"),
    "exclusiveMinimum": ("integer", "number"),
    "exclusiveMaximum": ("integer", "number"),
    "multipleOf": ("integer", "number"),
    "minItems": ("array",),
    "maxItems": ("array",),
    "prefixItems": ("array",),
    "unevaluatedItems": ("array",),
    "maxProperties": ("object",),
    "patternProperties": ("object",),
    "propertyNames": ("object",),
    "unevaluatedProperties": ("object",),
}
# the values "type" may name (xgrammar refuses any other only when it compiles the grammar)
JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# keywords beside which only annotations are kept (xgrammar reads the one and drops the rest)
ALONE = ("$ref", "anyOf", "oneOf", "allOf")
# every keyword that constrains (anything else in a schema is an unknown keyword: no constraint)
CONSTRAINTS = (
    set(IGNORED)
    | set(NEEDS_TYPE)
    | set(ALONE)
    | {"type", "enum", "const", "properties", "required", "additionalProperties"}
    | {"items", "minProperties", "uniqueItems"}
)
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True, slots=True)
class Unenforced:
    """A keyword the grammar would not hold: ``where`` is the JSON pointer of its schema."""

    keyword: str
    where: str
    why: str

    def message(self) -> str:
        return (
            f"the JSON schema's keyword {self.keyword!r} at {self.where} is not enforced by the "
            f"grammar, so it is refused: {self.why}"
        )


Refuse = Callable[[str, str], Unenforced]


def check_enforced(schema: Any, param: str | None = None) -> None:
    """InvalidRequestError naming the first keyword of ``schema`` the grammar would not hold;
    ``param``: the request field the schema is in (the message starts with it)."""
    found = unenforced(schema)
    if found is not None:
        prefix = f"{param}: " if param else ""
        raise InvalidRequestError(
            prefix + found.message(), param=param, code="unsupported_schema_keyword"
        )


def unenforced(schema: Any) -> Unenforced | None:
    """The first keyword of ``schema`` that the grammar would not hold (None: all are)."""
    return next(_walk(schema, schema, "#"), None)


def _walk(schema: Any, root: Any, where: str) -> Iterator[Unenforced]:
    if not isinstance(schema, dict):
        return
    yield from _check(schema, root, where)
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], root, f"{where}/{key}")
    for key in _SUBSCHEMAS:
        subs = schema.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else []):
            yield from _walk(sub, root, f"{where}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield from _walk(sub, root, f"{where}/{key}/{_escape(name)}")


def _check(schema: dict[str, Any], root: Any, where: str) -> Iterator[Unenforced]:
    def refuse(keyword: str, why: str) -> Unenforced:
        return Unenforced(keyword, where, why)

    for keyword, why in IGNORED.items():
        if keyword in schema:
            yield refuse(keyword, why)
    if schema.get("uniqueItems") is True:
        yield refuse("uniqueItems", "items may repeat under the grammar")
    if "$id" in schema and where != "#":
        yield refuse("$id", "a nested '$id' is not resolved; use '$defs' and a local '$ref'")
    ref = schema.get("$ref")
    if ref is not None and not (ref == "#" or (isinstance(ref, str) and ref.startswith("#/"))):
        yield refuse("$ref", "only local references (#/$defs/...) are resolved")
    constraints = [k for k in schema if k in CONSTRAINTS]
    for alone in ALONE:
        others = [k for k in constraints if k != alone]
        if alone in schema and others:
            yield refuse(others[0], f"keywords beside {alone!r} are dropped; move them into it")
    allof = schema.get("allOf")
    if isinstance(allof, list) and len(allof) > 1:
        yield refuse("allOf", "only one schema in 'allOf' is held; merge them into one")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root):
        yield refuse(
            "oneOf",
            "it is held as 'anyOf' (any branch), which differs unless the branches exclude "
            "each other by type or by a required property's const; use 'anyOf'",
        )
    yield from _values_only(schema, constraints, refuse)
    yield from _typed(schema, refuse)
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        declared = properties if isinstance(properties, dict) else {}
        for name in required:
            if isinstance(name, str) and name not in declared:
                yield refuse("required", f"{name!r} is required but not in 'properties'")


def _values_only(
    schema: dict[str, Any], constraints: list[str], refuse: Refuse
) -> Iterator[Unenforced]:
    """Beside ``enum`` / ``const`` the grammar holds the listed values only."""
    values = _listed_values(schema)
    if values is None:
        return
    for keyword in constraints:
        if keyword in ("enum", "const", "type"):
            continue
        yield refuse(keyword, "beside 'enum' or 'const' only the listed values are held")
    types = _types(schema)
    if types is not None and not all(_json_type(v) & types for v in values):
        yield refuse("type", "a listed value is not of this type, and the grammar allows it")


def _typed(schema: dict[str, Any], refuse: Refuse) -> Iterator[Unenforced]:
    types = _types(schema) or set()
    unknown = sorted(types - set(JSON_TYPES))
    if unknown:  # refused here, before a grammar is compiled for it
        names = ", ".join(JSON_TYPES)
        yield refuse("type", f'Unsupported type "{unknown[0]}": the types are {names}')
    for keyword, needs in NEEDS_TYPE.items():
        if keyword in schema and not types & set(needs):
            yield refuse(keyword, f"it is held only with 'type' {' or '.join(map(repr, needs))}")
    fmt = schema.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in FORMATS):
        yield refuse("format", f"the formats held are {', '.join(sorted(FORMATS))}")
    for shape in ("pattern", "format"):
        if shape in schema:
            for length in ("minLength", "maxLength"):
                if length in schema:
                    yield refuse(length, f"lengths beside {shape!r} are dropped")
    if "pattern" in schema and "format" in schema:
        yield refuse("pattern", "'format' replaces 'pattern' in the grammar; give one of them")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and ("(?=" in pattern or "(?!" in pattern):
        yield refuse("pattern", "lookahead assertions in a pattern are dropped")
    elif isinstance(pattern, str) and (problem := unreadable_pattern(pattern)) is not None:
        yield refuse("pattern", f"the grammar cannot read {problem} in {pattern!r}")
    patterns = schema.get("patternProperties")
    for name in patterns if isinstance(patterns, dict) else {}:
        if "(?=" in name or "(?!" in name:
            yield refuse("patternProperties", "lookahead assertions in a pattern are dropped")
    multiple = schema.get("multipleOf")
    whole = isinstance(multiple, int) or (isinstance(multiple, float) and multiple.is_integer())
    if multiple is not None and ("number" in types or not whole):
        yield refuse("multipleOf", "it is held only for 'type' 'integer' with a whole number")


def _disjoint(branches: list[Any], root: Any) -> bool:
    """No value can match two branches: their types differ, or each fixes one required
    property to a value no other branch allows (a tagged union)."""
    resolved = [_resolve(branch, root) for branch in branches]
    kinds = [_kinds(branch) for branch in resolved]
    if _pairwise_disjoint(kinds):
        return True
    if not resolved or not all(isinstance(b, dict) for b in resolved):
        return False
    common = set.intersection(*(_required(b) for b in resolved))
    for tag in sorted(common):
        tags = [_listed_values(_resolve(_property(b, tag), root)) for b in resolved]
        keyed = [None if t is None else {json.dumps(v, sort_keys=True) for v in t} for t in tags]
        if _pairwise_disjoint(keyed):
            return True
    return False


def _required(schema: dict[str, Any]) -> set[str]:
    required = schema.get("required")
    return {n for n in required if isinstance(n, str)} if isinstance(required, list) else set()


def _property(schema: dict[str, Any], name: str) -> Any:
    properties = schema.get("properties")
    return properties.get(name) if isinstance(properties, dict) else None


def _pairwise_disjoint(sets: list[set[str] | None]) -> bool:
    """No two sets share an element (False when one is unknown)."""
    seen: set[str] = set()
    for each in sets:
        if each is None or seen & each:
            return False
        seen |= each
    return True


def _kinds(schema: Any) -> set[str] | None:
    """The JSON types a schema allows, "integer" counted as "number" (None: unknown)."""
    if not isinstance(schema, dict):
        return None
    values = _listed_values(schema)
    types = set().union(*(_json_type(v) for v in values)) if values is not None else _types(schema)
    if types is None:
        return None
    return {"number" if t == "integer" else t for t in types}


def _types(schema: dict[str, Any]) -> set[str] | None:
    given = schema.get("type")
    if isinstance(given, str):
        return {given}
    if isinstance(given, list):
        return {t for t in given if isinstance(t, str)}
    return None


def _listed_values(schema: Any) -> list[Any] | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _resolve(schema: Any, root: Any) -> Any:
    """A local ``$ref`` followed (one level deep is what tagged unions need)."""
    if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
        return schema
    ref: str = schema["$ref"]
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return schema
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return schema
        node = node[part]
    return node


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
