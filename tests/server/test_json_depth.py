"""The nesting-depth check of request bodies agrees with the decoded value's depth, whatever
the strings hold (brackets, quotes, backslashes, escapes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.server.errors import ApiError
from asyncengine.server.json_depth import MAX_JSON_DEPTH, nests_deeper_than
from asyncengine.server.openai_schema import CompletionRequest, decode_body

TRICKY_TEXT = st.text(alphabet=st.sampled_from(list('ab[]{}"\\/\n é')), max_size=8)

values = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(TRICKY_TEXT, children, max_size=3)
    ),
    max_leaves=60,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=values, limit=st.integers(0, 6), ascii_only=st.booleans())
def test_agrees_with_the_decoded_depth(value: Any, limit: int, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nests_deeper_than(body, limit) == (depth(value) > limit)


def test_deep_bodies_are_caught_and_shallow_ones_pass() -> None:
    deep = b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    assert nests_deeper_than(deep)
    # never closed: not "deep" here; the decoder refuses it (at its recursion limit, or as
    # malformed where the bracket does not match) -> 400
    unbalanced = b'{"prompt": ' + b"[" * 3000 + b"}"
    with pytest.raises(ApiError, match="levels deep|not valid JSON") as refused:
        decode_body(unbalanced, CompletionRequest)
    assert refused.value.status == 400
    edge = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert not nests_deeper_than(edge)
    many = b'{"messages": [' + b",".join([b'{"role": "user", "content": "[[{{"}'] * 5000) + b"]}"
    assert not nests_deeper_than(many)
