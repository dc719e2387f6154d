"""The token each page-table row sampled last, kept where the model runs, so that a plan made
before the previous step landed (overlap scheduling: scheduler/plan_ahead.py) gets its
deferred decode inputs (``BatchPlan.deferred``) without the host waiting for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncengine.common.plan import BatchPlan


class LastSampled:
    """``tokens[row]``: the last token sampled for page-table row ``row``, on ``device``."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def fill(self, plan: BatchPlan, input_ids: torch.Tensor) -> None:
        """Write each deferred decode's input into ``input_ids`` (the forward's flat tokens:
        the extends' tokens, then one per decode), in place."""
        if not plan.deferred:
            return
        num_extend = sum(len(s.input_ids) for s in plan.extends)
        decodes = plan.decodes
        at = [num_extend + i for i in plan.deferred]
        rows = [decodes[i].row for i in plan.deferred]
        if any(len(s.input_ids) != 1 for s in decodes):
            raise ValueError(f"plan {plan.step} defers inputs beside multi-token decodes")
        input_ids[self._index(at)] = self.tokens[self._index(rows)]

    def record(self, plan: BatchPlan, token_ids: torch.Tensor | Sequence[int]) -> None:
        """The tokens just sampled for ``plan`` (one per sampled segment, plan order)."""
        rows = [s.row for s in plan.extends if s.sample] + [s.row for s in plan.decodes if s.sample]
        if not rows:
            return
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.tensor(list(token_ids), dtype=torch.int64)
        self.tokens[self._index(rows)] = token_ids.to(self.device, torch.int64)

    def _index(self, values: list[int]) -> torch.Tensor:
        index = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)
