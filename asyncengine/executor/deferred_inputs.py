"""The token each page-table row sampled last, kept where the model runs, so that a plan made
before the previous step landed (overlap scheduling: scheduler/plan_ahead.py) gets its
deferred decode inputs (``BatchPlan.deferred``) without the host waiting for them.

Both directions go over the index arrays ``build_forward_batch`` made with the step's other
inputs (``ForwardBatch.sampled_rows``, ``deferred_at``, ``deferred_rows``; on a GPU they
travel in the same copy): no pass over the plan's segments, no index copy of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncengine.executor.forward_batch import ForwardBatch


class LastSampled:
    """``tokens[row]``: the last token sampled for page-table row ``row``, on ``device``."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def fill(self, batch: ForwardBatch) -> None:
        """Write each deferred decode's input into ``batch.input_ids``, in place."""
        at, rows = batch.deferred_at, batch.deferred_rows
        if at is None or rows is None or not at.shape[0]:
            return
        batch.input_ids[at] = self.tokens[rows]

    def record(self, batch: ForwardBatch, token_ids: torch.Tensor | Sequence[int]) -> None:
        """The tokens just sampled for ``batch`` (one per sampled segment, plan order)."""
        rows = batch.sampled_rows
        if rows is None:
            raise ValueError("a batch without sampled_rows (not from build_forward_batch)")
        if not rows.shape[0]:
            return
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.tensor(list(token_ids), dtype=torch.int64)
        self.tokens[rows] = token_ids.to(self.device, torch.int64)
