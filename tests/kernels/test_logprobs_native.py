"""kernels/cpu/cpu_logprobs.c (row max, its first index, log-sum-exp) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from asyncengine.kernels.cpu import logprobs_native
from asyncengine.kernels.cpu.logprobs_native import row_max_lse, row_max_lse_ref

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
