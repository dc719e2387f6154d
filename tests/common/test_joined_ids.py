"""JoinedIds reads like ``prompt + output`` (indices, slices of any bounds and step) and keeps
the length it was made with when the output grows after."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncengine.common.joined_ids import JoinedIds

ids = st.lists(st.integers(0, 50), max_size=12)
bound = st.none() | st.integers(-30, 30)


@given(ids, ids, bound, bound, st.sampled_from([None, 1, 2, -1]))
def test_joined_ids_read_as_the_concatenation(
    prompt: list[int], output: list[int], start: int | None, stop: int | None, step: int | None
) -> None:
    joined = JoinedIds(prompt, output)
    whole = prompt + output
    assert len(joined) == len(whole) and list(joined) == whole
    assert joined[start:stop:step] == whole[start:stop:step]
    for i in range(-len(whole), len(whole)):
        assert joined[i] == whole[i]


@pytest.mark.parametrize("past", [3, -4])
def test_joined_ids_keep_their_length_and_refuse_indices_past_it(past: int) -> None:
    output = [3]
    joined = JoinedIds([1, 2], output)
    output.append(4)
    assert len(joined) == 3 and joined[-1] == 3 and joined[1:] == [2, 3]
    with pytest.raises(IndexError):
        joined[past]
