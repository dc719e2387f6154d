"""history: online quantiles of output lengths per tenant and prompt-length bucket.

Each request's key is its tenant and its prompt length's power-of-two bucket; the predictor
keeps the last ``window`` observed lengths per key and predicts their ``quantile``. A key with
fewer than ``min_samples`` observations falls back to the tenant's, then to all requests',
then to ``default`` tokens. Tenants come from clients (the ``user`` field), so at most
``max_keys`` keys are kept, the least recently observed forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncengine.policies.length_predictor import LengthPredictor, predictor_options

if TYPE_CHECKING:
    from asyncengine.common.request import Request

Key = tuple[str | None, int | None]


class HistoryPredictor(LengthPredictor):
    name = "history"

    def __init__(self, **options: Any) -> None:
        opts = predictor_options(
            self.name,
            options,
            {"quantile": 0.5, "window": 256, "min_samples": 4, "default": 128.0, "max_keys": 4096},
        )
        if (
            not 0 <= opts["quantile"] <= 1
            or opts["window"] < 1
            or opts["min_samples"] < 1
            or opts["max_keys"] < 3
        ):
            raise ValueError(
                "length predictor 'history': need 0 <= quantile <= 1, window >= 1, "
                "min_samples >= 1, max_keys >= 3"
            )
        self.quantile = opts["quantile"]
        self.window = opts["window"]
        self.min_samples = opts["min_samples"]
        self.default = opts["default"]
        self.max_keys = int(opts["max_keys"])
        self.seen: OrderedDict[Key, deque[int]] = OrderedDict()  # least recently observed first
        self._quantiles: dict[Key, float] = {}  # of ``seen``, dropped when a key grows

    @staticmethod
    def _keys(req: Request) -> tuple[Key, Key, Key]:
        bucket = max(0, len(req.prompt_ids) - 1).bit_length()
        tenant = req.params.tenant
        return (tenant, bucket), (tenant, None), (None, None)

    def predict(self, req: Request) -> float:
        for key in self._keys(req):
            cached = self._quantiles.get(key)
            if cached is not None:
                return cached
            lengths = self.seen.get(key)
            if lengths is not None and len(lengths) >= self.min_samples:
                value = float(np.quantile(np.fromiter(lengths, np.float64), self.quantile))
                self._quantiles[key] = value
                return value
        return float(self.default)

    def observe(self, req: Request, actual: int) -> None:
        for key in self._keys(req):
            lengths = self.seen.get(key)
            if lengths is None:
                lengths = self.seen[key] = deque(maxlen=self.window)
            else:
                self.seen.move_to_end(key)
            lengths.append(actual)
            self._quantiles.pop(key, None)
        while len(self.seen) > self.max_keys:
            gone, _ = self.seen.popitem(last=False)
            self._quantiles.pop(gone, None)
