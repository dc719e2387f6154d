"""Linear on the CPU: once its weight is packed for oneDNN it keeps only the packed copy (one
copy of the weights resident, not two), and still computes x @ W.T + b for any leading shape."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F

from asyncengine.executor.linear import Linear


def test_a_packed_linear_drops_the_plain_weight_and_multiplies_the_same() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    bias = torch.randn(96)
    x = torch.randn(5, 7, 64)
    want = F.linear(x, weight, bias)
    linear = Linear(weight.clone(), bias)
    assert linear.out_features == 96 and linear.dtype == torch.float32
    if linear.packed is None:  # a torch build without the mkldnn ops: the plain weight serves
        assert linear.weight is not None
    else:
        assert linear.weight is None
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[0]), want[0], rtol=1e-5, atol=1e-5)


def test_the_packed_linear_keeps_no_reference_to_the_weight_it_was_given() -> None:
    weight = torch.randn(32, 16)
    linear = Linear(weight)
    if linear.packed is None:
        return  # nothing packed: the weight is what it multiplies with (checked above)
    given = weakref.ref(weight)
    del weight
    gc.collect()
    assert given() is None
    assert linear(torch.ones(2, 16)).shape == (2, 32)
