"""The JSON-schema keywords refused as not enforced are the ones xgrammar's converter lets an
instance break, and those let through are held: each case is probed against xgrammar itself
(a compiled grammar and an instance that breaks the keyword), so an xgrammar upgrade that
changes either side shows here."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.structured.regex_reading import unreadable_pattern
from asyncengine.structured.schema_annotations import grammar_schema
from asyncengine.structured.schema_support import check_enforced, unenforced

INT_ARRAY = {"type": "array", "items": {"type": "integer"}}

# (schema, an instance it forbids, the keyword refused, where)
REFUSED: list[tuple[dict[str, Any], Any, str, str]] = [
    ({"type": "object", "properties": {"t": {**INT_ARRAY, "uniqueItems": True}}}, {"t": [1, 1]},
     "uniqueItems", "#/properties/t"),
    ({"type": "integer", "not": {"const": 3}}, 3, "not", "#"),
    ({"type": "string", "pattern": "^(?=a)[a-z]+$"}, "bz", "pattern", "#"),
    ({"type": "string", "format": "email", "maxLength": 9}, "abcdefg@cd.com", "maxLength", "#"),
    ({"type": "string", "pattern": "[a-z]+", "minLength": 3}, "ab", "minLength", "#"),
    ({"type": "string", "pattern": "^a", "format": "email"}, "bb@cd.com", "pattern", "#"),
    ({"type": "string", "format": "iri"}, "x y", "format", "#"),
    ({"minimum": 2}, 1, "minimum", "#"),
    ({"minLength": 2}, "a", "minLength", "#"),
    ({"minItems": 2}, [1], "minItems", "#"),
    ({"type": "number", "multipleOf": 2}, 3, "multipleOf", "#"),
    ({"type": "integer", "multipleOf": 1.5}, 4, "multipleOf", "#"),
    ({**INT_ARRAY, "contains": {"const": 5}}, [1], "contains", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}, "if",
     "#"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 2, "allOf", "#"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, "oneOf", "#"),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": 0}]}, "s", "type", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x", "maximum": 3}},
      "required": ["a"], "$defs": {"x": {"type": "integer"}}}, {"a": 5}, "maximum",
     "#/properties/a"),
    ({"type": "string", "enum": ["a", 1]}, 1, "type", "#"),
    ({"enum": ["a", "bbb"], "minLength": 2}, "a", "minLength", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
      "additionalProperties": True}, {"a": 1}, "required", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#x"}}, "required": ["a"],
      "$defs": {"x": {"$anchor": "x", "type": "integer"}}}, {"a": "s"}, "$ref",
     "#/properties/a"),
]  # fmt: skip

# (schema, an instance it forbids): held by the grammar, so let through
HELD: list[tuple[Any, Any]] = [
    ({"type": "string", "pattern": "^[a-z]+$"}, "B"),
    ({"type": "string", "pattern": r"^\\b(?:\d{1,3})$"}, "b1"),  # an escaped backslash, then b
    ({"type": "string", "maxLength": 2, "description": "short"}, "abc"),
    ({"type": ["string", "null"], "minLength": 3, "title": "T"}, "a"),
    ({"type": "string", "format": "date"}, "x"),
    ({"type": "integer", "minimum": 3, "examples": [4]}, 2),
    ({"type": "number", "exclusiveMaximum": 1.5}, 1.5),
    ({"type": "integer", "multipleOf": 3}, 4),
    ({**INT_ARRAY, "minItems": 2, "uniqueItems": False}, [1]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, 2),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, None),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}, "s"),
    ({"type": "string", "enum": ["a", "b"]}, "c"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x", "description": "d"}},
      "required": ["a"], "$defs": {"x": {"type": "integer"}}}, {"a": "s"}),
    ({"type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"},
      {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}}}, "required": ["pet"],
      "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}},
      "required": ["kind"]}, "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}},
      "required": ["kind"]}}}, {"pet": {"kind": "cow"}}),
]  # fmt: skip


def accepts(schema: Any, instance: Any) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return any(  # either layout xgrammar's compact JSON may take
        _is_grammar_accept_string(grammar, json.dumps(instance, separators=separators))
        for separators in ((",", ":"), (", ", ": "))
    )


@pytest.mark.parametrize(("schema", "instance", "keyword", "where"), REFUSED)
def test_a_keyword_the_grammar_drops_is_refused(
    schema: dict[str, Any], instance: Any, keyword: str, where: str
) -> None:
    assert accepts(schema, instance)  # xgrammar lets the instance through
    found = unenforced(schema)
    assert found is not None and (found.keyword, found.where) == (keyword, where)
    with pytest.raises(InvalidRequestError, match=re.escape(f"'{keyword}' at {where} ")) as caught:
        check_enforced(schema, "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"
    assert caught.value.code == "unsupported_schema_keyword"


@pytest.mark.parametrize(("schema", "instance"), HELD)
def test_a_keyword_the_grammar_holds_is_let_through(schema: Any, instance: Any) -> None:
    assert not accepts(schema, instance)  # xgrammar holds it
    assert unenforced(schema) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": ["email"]},
        {"type": "integer", "multipleOf": "2"},
        {"type": "object", "required": [{"a": 1}, 3], "properties": []},
        {"type": "object", "patternProperties": [1, 2]},
        {"oneOf": [{"required": [[1]]}, {"required": [{"b": 2}]}]},
        {"$ref": 5, "items": [1, {"not": 1}], "properties": {"a": None}, "type": 7},
    ],
)
def test_odd_values_do_not_crash_the_check(schema: dict[str, Any]) -> None:
    unenforced(schema)  # xgrammar itself refuses what is malformed; the check only reads


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "objec"}, "#"),
        ({"type": ["string", "nul"]}, "#"),
        ({"type": "object", "properties": {"a": {"type": "int"}}}, "#/properties/a"),
    ],
)
def test_an_unknown_type_is_refused_before_a_grammar_is_compiled(
    schema: dict[str, Any], where: str
) -> None:
    """xgrammar refuses an unknown type only when it compiles the grammar (in the compile
    workers, seconds on a loaded machine): the check refuses it first, naming it."""
    with pytest.raises(RuntimeError, match="Unsupported type"):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    with pytest.raises(InvalidRequestError, match=f"'type' at {re.escape(where)} .*Unsupported"):
        check_enforced(schema, "response_format.json_schema.schema")


@pytest.mark.parametrize(
    "pattern",
    [r"(?<=a)b", r"(a)\1", r"\bword\b", r"^\p{L}+$", r"(?>a)b", r"a{,3}", r"[\\]\b", r"[^\b]\B"],
)
def test_a_pattern_xgrammar_cannot_read_is_refused_or_left_out(pattern: str) -> None:
    """Lookbehind, backreferences, word boundaries, Unicode property classes, atomic
    groups: xgrammar fails the whole grammar's compile. A constraint is refused naming the
    pattern; a schema that only describes (a tool under "auto") keeps everything else."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": pattern},
            "b": {"type": "string", "pattern": "^[a-z]+$"},
        },
        "required": ["a", "b"],
    }
    with pytest.raises(RuntimeError, match="Regex parsing error"):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    expected = f"'pattern' at #/properties/a .*cannot read .+ in {re.escape(repr(pattern))}"
    with pytest.raises(InvalidRequestError, match=expected):
        check_enforced(schema, "tools[0].function.parameters")
    described = grammar_schema(schema, readable_patterns_only=True)
    assert described["properties"] == {
        "a": {"type": "string"},
        "b": {"type": "string", "pattern": "^[a-z]+$"},
    }
    assert grammar_schema(schema) == schema  # a constraint's schema is never trimmed
    assert accepts(described, {"a": "anything", "b": "ab"})
    assert not accepts(described, {"a": "anything", "b": "AB"})


# (pattern, a string it holds, one it refuses): escapes and groups inside a class, which
# xgrammar reads as ECMA-262 does (a backspace for \b, else the characters themselves)
IN_CLASS: list[tuple[str, str, str]] = [
    (r"^[\bx]+$", "x", "b"),  # a backspace: no word boundary, no "b"
    (r"^[\B]+$", "B", "b"),
    (r"^[\1]+$", "1", "2"),
    (r"^[\k]+$", "k", "<"),
    (r"^[(?<=a)]+$", "(?<=", "b"),
    (r"^[(?>a)]+$", "?>", "b"),
    (r"^[{,3}]+$", "{,", "4"),
    (r"^[\]\b]+$", "]", "b"),
]


def _string_pattern(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}},
            "required": ["a"]}  # fmt: skip


@pytest.mark.parametrize(("pattern", "held", "refused"), IN_CLASS)
def test_escapes_inside_a_class_that_xgrammar_reads_are_let_through(
    pattern: str, held: str, refused: str
) -> None:
    schema = _string_pattern(pattern)
    assert accepts(schema, {"a": held}) and not accepts(schema, {"a": refused})
    assert unreadable_pattern(pattern) is None
    check_enforced(schema)
    assert grammar_schema(schema, readable_patterns_only=True) == schema


@pytest.mark.parametrize(
    ("pattern", "letters"), [(r"^[\p{L} ]+$", "p{L}"), (r"^[a\]\P{Lu}]+$", "P{}")]
)
def test_a_property_class_inside_a_class_is_refused_as_xgrammar_reads_its_letters(
    pattern: str, letters: str
) -> None:
    """xgrammar compiles it, but as the characters "p", "{", ... where JSON Schema's Unicode
    reading means a letter: held, the model could write only those."""
    schema = _string_pattern(pattern)
    assert accepts(schema, {"a": letters}) and not accepts(schema, {"a": "é"})
    with pytest.raises(InvalidRequestError, match="inside \\[...\\], which xgrammar reads as"):
        check_enforced(schema, "tools[0].function.parameters")
    assert grammar_schema(schema, readable_patterns_only=True)["properties"]["a"] == {
        "type": "string"
    }
