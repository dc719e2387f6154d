"""LastSampled over the batch's index arrays: a plan made ahead takes each deferred decode's
input from the token its page-table row sampled last, whatever else the plan holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.deferred_inputs import LastSampled
from asyncengine.executor.forward_batch import build_forward_batch

PAGE = 4
CPU = torch.device("cpu")


def _table() -> np.ndarray:
    return np.random.default_rng(0).permutation(32 * 8).astype(np.int32).reshape(32, 8)


@pytest.mark.parametrize("with_extends", [False, True])
def test_deferred_decodes_take_their_rows_last_sampled_tokens(with_extends: bool) -> None:
    table = _table()
    last = LastSampled(32, CPU)
    # step N samples rows 5, 9, 2 (an extend's last chunk, then two decodes) and row 7 does not
    landed = BatchPlan(
        step=1,
        extends=[Segment("a", 5, [11, 12, 13], 0, True), Segment("b", 7, [14, 15], 0, False)],
        decodes=[Segment("c", 9, [16], 6, True), Segment("d", 2, [17], 3, True)],
    )
    batch = build_forward_batch(landed, table, PAGE, CPU)
    assert batch.sampled_rows is not None and batch.sampled_rows.tolist() == [5, 9, 2]
    last.record(batch, torch.tensor([105, 109, 102]))
    # step N + 1, planned before N landed: rows 9, 5 and 2 decode the tokens N sampled, row 4
    # a token the host knows; a prompt chunk may go first
    extends = [Segment("e", 3, [21, 22], 0, False)] if with_extends else []
    ahead = BatchPlan(
        step=2,
        extends=extends,
        decodes=[
            Segment("c", 9, [-1], 7, True),
            Segment("f", 4, [44], 2, True),
            Segment("a", 5, [-1], 3, True),
            Segment("d", 2, [-1], 4, True),
        ],
        deferred=[0, 2, 3],
    )
    batch = build_forward_batch(ahead, table, PAGE, CPU)
    last.fill(batch)
    head = [21, 22] if with_extends else []
    assert batch.input_ids.tolist() == [*head, 109, 44, 105, 102]
    assert batch.sampled_rows is not None and batch.sampled_rows.tolist() == [9, 4, 5, 2]
    # the tokens N + 1 samples replace them, row by row; a row not sampled keeps its own
    last.record(batch, [209, 204, 205, 202])
    assert last.tokens[[9, 4, 5, 2, 7]].tolist() == [209, 204, 205, 202, 0]


def test_a_lone_deferred_decode_takes_the_vectorized_path() -> None:
    table = _table()
    last = LastSampled(32, CPU)
    last.tokens[6] = 1234
    plan = BatchPlan(step=3, decodes=[Segment("a", 6, [-1], 9, True)], deferred=[0])
    batch = build_forward_batch(plan, table, PAGE, CPU)
    last.fill(batch)
    assert batch.input_ids.tolist() == [1234]
    assert batch.positions.tolist() == [9]


def test_deferred_inputs_beside_guesses_are_refused() -> None:
    plan = BatchPlan(step=1, decodes=[Segment("a", 0, [-1, 5], 3, True, guesses=1)], deferred=[0])
    with pytest.raises(ValueError, match="defers inputs beside guessed tokens"):
        build_forward_batch(plan, _table(), PAGE, CPU)


def test_a_deferred_multi_token_decode_is_refused() -> None:
    plan = BatchPlan(step=1, decodes=[Segment("a", 0, [-1, 5], 3, True)], deferred=[0])
    with pytest.raises(ValueError, match="has 2 tokens"):
        build_forward_batch(plan, _table(), PAGE, CPU)
