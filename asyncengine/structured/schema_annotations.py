"""A JSON schema as the grammar is given it: less its annotations, the keywords that describe a
value without constraining it (``description``, ``title``, ``examples``, ...), and with
OpenAPI's ``nullable: true`` read as JSON Schema says it (``null`` among the ``type``s). A
tool's descriptions can be most of an agent's tool set, and they bound nothing, so they neither
count toward the grammar's size limit nor cost its compile; ``nullable`` is how clients
generated from OpenAPI 3.0 specs allow null, which the grammar would otherwise ignore as an
unknown keyword. Only keywords at schema positions change; a property *named* "description"
stays.
"""

from __future__ import annotations

from typing import Any

from asyncengine.structured.regex_reading import unreadable_pattern

ANNOTATIONS = frozenset(
    {
        "description",
        "title",
        "examples",
        "$comment",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
ONE_SCHEMA = frozenset(
    {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
     "additionalItems", "unevaluatedItems", "unevaluatedProperties"}
)  # fmt: skip
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def grammar_schema(schema: Any, readable_patterns_only: bool = False) -> Any:
    """``schema`` (a JSON schema, or a boolean one) with its annotation keywords removed and
    ``nullable`` read at every schema position; a new object, ``schema`` left as it is.
    ``readable_patterns_only``: leave out each ``pattern`` the grammar cannot read (a tool
    that is only described: its call keeps to what the grammar can hold, as xgrammar drops a
    lookahead), where a constraint's schema was refused for it (schema_support.py)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS or key == "nullable":
            continue
        if key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [grammar_schema(item, readable_patterns_only) for item in value]
        elif key in ONE_SCHEMA:
            out[key] = grammar_schema(value, readable_patterns_only)
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {
                name: grammar_schema(sub, readable_patterns_only) for name, sub in value.items()
            }
        elif (
            key == "pattern"
            and readable_patterns_only
            and isinstance(value, str)
            and unreadable_pattern(value) is not None
        ):
            continue
        else:
            out[key] = value  # enum, const, required, type, bounds: as written
    if schema.get("nullable") is True and "type" in out:
        out["type"] = _with_null(out["type"])
    return out


def _with_null(given: Any) -> Any:
    """A ``type`` that also allows null (OpenAPI 3.0.3: nullable acts only beside a type)."""
    types = [given] if isinstance(given, str) else list(given) if isinstance(given, list) else []
    if not types or "null" in types:
        return given
    return [*types, "null"]
