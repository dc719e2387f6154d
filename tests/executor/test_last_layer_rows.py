"""The last layer's o_proj and MLP run only on the rows whose hidden states the forward keeps
(the sampled ones): every earlier layer sees all the step's tokens, every row's K/V is stored,
and the logits still match Hugging Face transformers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncengine.common.plan import BatchPlan
from tests.conftest import TinyCheckpoint
from tests.executor.test_model_parity import MAX_LEN, Harness, hf_logits, seg


def rows_seen(linear: Any, calls: list[int]) -> Any:
    def counted(x: torch.Tensor) -> Any:
        calls.append(x.shape[0])
        return linear(x)

    return counted


def test_last_layer_runs_the_kept_rows_only(tiny_llama: TinyCheckpoint) -> None:
    h = Harness(tiny_llama, page_size=4)
    model = h.runner.model
    first, last = model.layers[0], model.layers[-1]
    seen: dict[str, list[int]] = {"first": [], "last_o": [], "last_mlp": []}
    first.gate_up = rows_seen(first.gate_up, seen["first"])  # type: ignore[assignment]
    last.o_proj = rows_seen(last.o_proj, seen["last_o"])  # type: ignore[assignment]
    last.gate_up = rows_seen(last.gate_up, seen["last_mlp"])  # type: ignore[assignment]
    rng = np.random.default_rng(3)
    vocab = h.config.vocab_size
    full = {rid: rng.integers(3, vocab, MAX_LEN).tolist() for rid in "abc"}
    plan = BatchPlan(
        step=1,
        extends=[
            seg("a", 0, full["a"][:9], 0),
            seg("c", 2, full["c"][:12], 0, sample=False),  # mid-prefill: K/V only
            seg("b", 1, full["b"][:20], 0),
        ],
    )
    logits = h.runner.forward_logits(plan)
    assert seen == {"first": [41], "last_o": [2], "last_mlp": [2]}
    want = torch.stack([hf_logits(tiny_llama, full["a"])[8], hf_logits(tiny_llama, full["b"])[19]])
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    # c's last-layer K/V was stored: its next chunk attends over it and matches
    plan = BatchPlan(step=2, extends=[seg("c", 2, full["c"][12:17], 12)])
    torch.testing.assert_close(
        h.runner.forward_logits(plan), hf_logits(tiny_llama, full["c"])[16:17], rtol=0, atol=1e-4
    )
    assert seen["last_mlp"] == [2, 1]
