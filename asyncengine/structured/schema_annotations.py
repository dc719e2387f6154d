"""A JSON schema less its annotations: the keywords that describe a value without constraining
it (``description``, ``title``, ``examples``, ...). A tool's schema goes into its call grammar
this way: descriptions can be most of an agent's tool set, and they bound nothing, so they
neither count toward the grammar's size limit nor cost its compile. Only keywords at schema
positions go; a property *named* "description" stays.
"""

from __future__ import annotations

from typing import Any

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
_ONE = frozenset(
    {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
     "additionalItems", "unevaluatedItems", "unevaluatedProperties"}
)  # fmt: skip
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def without_annotations(schema: Any) -> Any:
    """``schema`` (a JSON schema, or a boolean one) with its annotation keywords removed at
    every schema position; a new object, ``schema`` left as it is."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS:
            continue
        if key in _LIST and isinstance(value, list):
            out[key] = [without_annotations(item) for item in value]
        elif key in _ONE:
            out[key] = without_annotations(value)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: without_annotations(sub) for name, sub in value.items()}
        else:
            out[key] = value  # enum, const, required, type, bounds: as written
    return out
