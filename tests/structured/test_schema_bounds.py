"""Bounds that break JSON Schema's rules, or that no value meets, are refused naming the keyword,
where it is and the rule, before xgrammar reads them: each case is probed against xgrammar
itself (it refuses the schema in its own words, or misreads the bound), so an xgrammar upgrade
that changes either side shows here."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from asyncengine.structured.schema_bounds import bounds_problem, bounds_problem_in_spec

STR = {"type": "string"}
ARRAY = {"type": "array"}
OBJ = {"type": "object"}
INT = {"type": "integer"}
NUM = {"type": "number"}

# (schema, what the refusal says): xgrammar refuses each in words of its own
REFUSED_BY_XGRAMMAR: list[tuple[dict[str, Any], str]] = [
    ({"type": "object", "properties": {"a": {**STR, "minLength": -1}}},
     "'minLength' at #/properties/a must be a non-negative integer (at most 2147483647), not -1"),
    ({**STR, "minLength": 1.5}, "'minLength' at # must be a non-negative integer"),
    ({**STR, "minLength": "3"}, "'minLength' at # must be a non-negative integer"),
    ({**STR, "minLength": True}, "'minLength' at # must be a non-negative integer"),
    ({**STR, "minLength": 5, "maxLength": 2}, "'minLength' 5 at # is above its 'maxLength' 2"),
    ({**ARRAY, "maxItems": -1}, "'maxItems' at # must be a non-negative integer"),
    ({**ARRAY, "minItems": 3, "maxItems": 1}, "'minItems' 3 at # is above its 'maxItems' 1"),
    ({**OBJ, "minProperties": -1}, "'minProperties' at # must be a non-negative integer"),
    ({**OBJ, "maxProperties": -2}, "'maxProperties' at # must be a non-negative integer"),
    ({**OBJ, "minProperties": 3, "maxProperties": 1},
     "'minProperties' 3 at # is above its 'maxProperties' 1"),
    ({**INT, "minimum": 5, "maximum": 2},
     "'minimum' 5 and 'maximum' 2 at # leave no integer between them"),
    ({**NUM, "minimum": 5, "maximum": 2},
     "'minimum' 5 and 'maximum' 2 at # leave no number between them"),
    ({**INT, "exclusiveMinimum": 2, "exclusiveMaximum": 3},
     "'exclusiveMinimum' 2 and 'exclusiveMaximum' 3 at # leave no integer between them"),
    ({**NUM, "minimum": 2, "exclusiveMaximum": 2},
     "'minimum' 2 and 'exclusiveMaximum' 2 at # leave no number between them"),
    ({"type": ["integer", "string"], "minimum": 5, "maximum": 2}, "leave no integer"),
    ({**INT, "minimum": "1"}, "'minimum' at # must be a number, not \"1\""),
    ({**NUM, "minimum": 1, "exclusiveMinimum": True},
     "'exclusiveMinimum' at # must be a number, not true (draft 4's"),
    ({**INT, "multipleOf": 0}, "'multipleOf' at # must be greater than 0, not 0"),
    ({**INT, "multipleOf": -2}, "'multipleOf' at # must be greater than 0, not -2"),
    ({**INT, "minimum": 1.5, "maximum": 7}, "'minimum' at # must be a whole number"),
    ({**ARRAY, "items": {**ARRAY, "minItems": 1.5}}, "'minItems' at #/items must be"),
    ({"$defs": {"n/m": {**ARRAY, "maxItems": 2.0}}, "$ref": "#/$defs/n~1m"},
     "'maxItems' at #/$defs/n~1m must be a non-negative integer"),
]  # fmt: skip

# (schema, an instance xgrammar gets wrong): it reads the bound as something else, silently
MISREAD_BY_XGRAMMAR: list[tuple[dict[str, Any], Any, bool, str]] = [
    ({**STR, "maxLength": -1}, "abcdefgh", True, "'maxLength' at # must be"),  # no bound
    ({**ARRAY, "minItems": -1}, [1], False, "'minItems' at # must be"),  # read as maxItems 0
    ({**STR, "maxLength": 2**31}, "abc", True, "(at most 2147483647), not 2147483648"),
]

# bounds JSON Schema allows and some value meets, or that do not apply to the schema's type
FINE: list[dict[str, Any]] = [
    {**STR, "minLength": 0, "maxLength": 5},
    {**ARRAY, "items": INT, "minItems": 2, "maxItems": 2},
    {**ARRAY, "maxItems": 0},
    {**NUM, "minimum": 2, "maximum": 2},
    {**NUM, "multipleOf": 0.5, "minimum": -1.5},
    {**INT, "minimum": 2, "exclusiveMaximum": 3},
    {**INT, "minimum": 1.0, "maximum": 4},
    {**STR, "minimum": 5, "maximum": 2},  # numeric bounds on a string: no number is asked for
    {"minimum": 5, "maximum": 2},  # untyped: xgrammar drops them (schema_support.py refuses)
    {"type": "object", "properties": {"minLength": {**STR, "minLength": 1}}},
]


def _grammar(schema: dict[str, Any]) -> Any:
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


@pytest.mark.parametrize(("schema", "says"), REFUSED_BY_XGRAMMAR)
def test_a_bound_xgrammar_refuses_is_refused_in_words_naming_it(
    schema: dict[str, Any], says: str
) -> None:
    with pytest.raises(RuntimeError):
        accepted = _grammar(schema)
        # some only fail where the grammar is read: its repetition range
        _is_grammar_accept_string(accepted, '""')
    problem = bounds_problem(schema)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize(("schema", "instance", "accepted", "says"), MISREAD_BY_XGRAMMAR)
def test_a_bound_xgrammar_misreads_is_refused(
    schema: dict[str, Any], instance: Any, accepted: bool, says: str
) -> None:
    assert _is_grammar_accept_string(_grammar(schema), json.dumps(instance)) is accepted
    problem = bounds_problem(schema)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize("schema", FINE)
def test_bounds_some_value_meets_pass(schema: dict[str, Any]) -> None:
    _grammar(schema)
    assert bounds_problem(schema) is None


def test_each_schema_of_a_structural_tag_is_checked() -> None:
    def tag(schema: dict[str, Any]) -> str:
        content = {"type": "json_schema", "json_schema": schema}
        call = {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"}
        fmt = {"type": "or", "elements": [call, {**call, "begin": "<b>"}]}
        return json.dumps({"type": "structural_tag", "format": fmt})

    assert bounds_problem_in_spec("structural_tag", tag(FINE[0])) is None
    bad = {"type": "object", "properties": {"n": {**STR, "minLength": -1}}}
    problem = bounds_problem_in_spec("structural_tag", tag(bad))
    assert problem is not None and re.match(r"'minLength' at #/properties/n must", problem)
    assert bounds_problem_in_spec("regex", "[a-z]{-1}") is None  # not a schema: the compiler's
    assert bounds_problem_in_spec("json_schema", "{not json") is None
