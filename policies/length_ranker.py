"""ranker: a small linear model of log output length on cheap prompt features, trained online.

Features (no model forward): a bias, log prompt length, and hashed one-hot buckets of the
tenant and of the prompt's first ``head_tokens`` token ids (a template or system prompt says
much about the task). Each ending request is one step of least-mean-squares on
``log1p(actual)`` (normalized by the features' norm, so the step size needs no tuning). Only
the order of its predictions matters to the policies that use it (sjf, ltr): a pointwise
learning-to-rank model.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncengine.policies.length_predictor import LengthPredictor, predictor_options

if TYPE_CHECKING:
    from asyncengine.common.request import Request


class RankerPredictor(LengthPredictor):
    name = "ranker"

    def __init__(self, **options: Any) -> None:
        opts = predictor_options(
            self.name,
            options,
            {"buckets": 64, "head_tokens": 8, "learning_rate": 0.5, "default": 128.0},
        )
        if opts["buckets"] < 1 or opts["head_tokens"] < 0 or not 0 < opts["learning_rate"] <= 1:
            raise ValueError(
                "length predictor 'ranker': need buckets >= 1, head_tokens >= 0, "
                "0 < learning_rate <= 1"
            )
        self.buckets = opts["buckets"]
        self.head_tokens = opts["head_tokens"]
        self.learning_rate = opts["learning_rate"]
        self.weights = np.zeros(2 + 2 * self.buckets)
        self.weights[0] = math.log1p(opts["default"])
        self.trained = 0

    def features(self, req: Request) -> tuple[np.ndarray, np.ndarray]:
        """The dense part (bias, log prompt length) and the indices of the hashed one-hots."""
        dense = np.array([1.0, math.log1p(len(req.prompt_ids)) / 8.0])
        tenant = zlib.crc32(str(req.params.tenant).encode()) % self.buckets
        head = np.asarray(req.prompt_ids[: self.head_tokens], dtype=np.int64).tobytes()
        template = zlib.crc32(head) % self.buckets
        return dense, np.array([2 + tenant, 2 + self.buckets + template])

    def predict(self, req: Request) -> float:
        dense, hot = self.features(req)
        score = float(dense @ self.weights[:2] + self.weights[hot].sum())
        return math.expm1(min(max(score, 0.0), 20.0))

    def observe(self, req: Request, actual: int) -> None:
        dense, hot = self.features(req)
        error = math.log1p(actual) - float(dense @ self.weights[:2] + self.weights[hot].sum())
        step = self.learning_rate * error / (float(dense @ dense) + len(hot))
        self.weights[:2] += step * dense
        self.weights[hot] += step
        self.trained += 1
