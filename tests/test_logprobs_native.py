"""kernels/cpu_logprobs.c (row max, its first index, log-sum-exp) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels import logprobs_native
from asyncengine.kernels.logprobs_native import row_max_lse, row_max_lse_ref

pytestmark = pytest.mark.skipif(
    not logprobs_native.available(), reason="no C compiler for the native CPU kernels"
)


@pytest.mark.parametrize("vocab", [1, 7, 16, 50, 49152])
def test_equals_the_reference(vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab) * 6
    got, want = row_max_lse(logits), row_max_lse_ref(logits)
    assert torch.equal(got.max, want.max)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.lse, want.lse, rtol=2e-6, atol=1e-6)
    log_softmax = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(9)
    torch.testing.assert_close(
        logits[rows, got.argmax] - got.lse, log_softmax.max(dim=-1).values, rtol=0, atol=1e-5
    )


def test_strided_rows_ties_and_extremes() -> None:
    """Rows of a wider tensor (a chunk's scored rows), the first of equal maxima, -inf logits
    (masked tokens) and logits far from zero."""
    wide = torch.randn(4, 300) * 3
    wide[0, 100] = wide[0, 230] = 50.0  # a tie: the first index
    wide[1, :] = float("-inf")
    wide[1, 99] = 2.0  # one finite logit: lse is it
    wide[2] += 1000.0
    rows = wide[:, 40:290]
    assert not rows.is_contiguous()
    got = row_max_lse(rows)
    assert got.argmax.tolist()[:2] == [100 - 40, 99 - 40]
    assert got.lse[1] == 2.0
    want = row_max_lse_ref(rows.contiguous())
    torch.testing.assert_close(got.lse, want.lse, rtol=2e-6, atol=1e-5)
    assert torch.equal(got.max, want.max)


@pytest.mark.parametrize("vocab", [1, 7, 8, 50, 49152])
def test_argmax_equals_torch(vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab) * 6
    assert torch.equal(logprobs_native.row_argmax(logits), logits.argmax(dim=-1))


def test_argmax_ties_infinities_nan_and_strides() -> None:
    """The first of equal maxima, rows of -inf, +inf, NaN (torch takes the first NaN) in the
    vector part and in the tail, and rows of a wider tensor."""
    wide = torch.randn(6, 300)
    wide[0, 100] = wide[0, 230] = 50.0
    wide[1, :] = float("-inf")
    wide[2, 77] = float("inf")
    wide[3, 120] = float("nan")
    wide[3, 200] = 1e9
    wide[4, 288] = float("nan")  # in the tail of the 250-wide rows below (250 = 31 * 8 + 2)
    wide[5, 41] = float("nan")
    wide[5, 45] = float("nan")
    rows = wide[:, 40:290]
    assert not rows.is_contiguous()
    got = logprobs_native.row_argmax(rows)
    assert torch.equal(got, rows.argmax(dim=-1))
    assert got.tolist() == [60, 0, 37, 80, 248, 1]
