"""Output-length prediction as a plug-in: ``LengthPredictor`` and the predictions a run made.

A predictor says how many tokens a request will generate (``predict``) and hears the truth
when the request ends by itself (``observe``: EOS, stop, length). Policies that rank by job
size (sjf, ltr) ask through ``PolicyContext.predicted_len``; ``LengthPredictions`` asks the
predictor once per request, remembers the answer, feeds each ending back, and scores the
predictions it made against the actual lengths (Kendall's tau-b over the latest
``SCORED_PAIRS`` endings: 1 orders every pair right, 0 is no better than chance).

Built-ins (``length_predictor`` in the config; policies/length_registry.py loads them or
"pkg.mod:Class"): ``max-tokens`` (the request's own ``max_new_tokens``: the engine's old
behaviour; in the simulator that is the trace's length, an oracle), ``oracle`` (the trace's
lengths; simulator only), ``history`` (policies/length_history.py) and ``ranker``
(policies/length_ranker.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncengine.policies.base import take_options

if TYPE_CHECKING:
    from asyncengine.common.request import Request

NATURAL_ENDS = ("stop", "length")  # the request generated all it was going to
# the (predicted, actual) pairs a score is computed over: the latest ones (a server runs for
# days)
SCORED_PAIRS = 3000


class LengthPredictor:
    """Predicts a request's output length in tokens. Subclass: ``predict`` and ``observe``."""

    name = "base"

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(
                f"length predictor {self.name!r} takes no options, got {sorted(options)}"
            )

    def predict(self, req: Request) -> float:
        raise NotImplementedError

    def observe(self, req: Request, actual: int) -> None:
        """``req`` ended by itself after generating ``actual`` tokens."""
        return None


class MaxTokensPredictor(LengthPredictor):
    """The request's ``max_new_tokens``: what it may generate at most."""

    name = "max-tokens"

    def predict(self, req: Request) -> float:
        return float(req.params.max_new_tokens)


class OraclePredictor(LengthPredictor):
    """The actual lengths, known only to the simulator (it ``reveal``s the trace's)."""

    name = "oracle"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.lengths: dict[str, int] = {}

    def reveal(self, lengths: Mapping[str, int]) -> None:
        self.lengths.update(lengths)

    def predict(self, req: Request) -> float:
        try:
            return float(self.lengths[req.rid])
        except KeyError:
            raise ValueError(
                f"length predictor 'oracle' does not know request {req.rid!r}: it knows "
                "output lengths only in the simulator, from the trace"
            ) from None


class LengthPredictions:
    """The predictions of one engine's predictor, scored at the end. A request is asked about
    again only once the predictor has observed something since (it may have learned); the
    prediction scored is the last one made, the one its admission went by."""

    def __init__(self, predictor: LengthPredictor) -> None:
        self.predictor = predictor
        self._made: dict[int, tuple[int, float]] = {}  # id(request) -> (observed, prediction)
        self.observed = 0  # endings fed back to the predictor
        # (predicted, actual) of the latest natural endings; ``scored`` counts them all
        self.pairs: deque[tuple[float, int]] = deque(maxlen=SCORED_PAIRS)
        self.scored = 0

    def predicted_len(self, req: Request) -> float:
        key = id(req)
        made = self._made.get(key)
        if made is None or made[0] != self.observed:
            made = self._made[key] = (self.observed, float(self.predictor.predict(req)))
        return made[1]

    def finished(self, req: Request) -> None:
        made = self._made.pop(id(req), None)
        if req.finish_reason not in NATURAL_ENDS:
            return
        actual = len(req.output_ids)
        self.predictor.observe(req, actual)
        self.observed += 1
        if made is not None:
            self.pairs.append((made[1], actual))
            self.scored += 1

    def stats(self) -> dict[str, Any]:
        predicted = [p for p, _ in self.pairs]
        actual = [a for _, a in self.pairs]
        return {
            "name": self.predictor.name,
            "scored": self.scored,
            "kendall_tau": kendall_tau(predicted, actual),
        }


def kendall_tau(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Kendall's tau-b of two rankings (nan with fewer than two items or a constant one).
    Knight's O(n log n) count: ``stats`` runs on the event loop at every /metrics scrape."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = int(a.size)
    if n < 2:
        return float("nan")
    order = np.lexsort((b, a))  # by a, ties by b: a pair tied in a is never counted discordant
    a, b = a[order], b[order]
    pairs = n * (n - 1) // 2
    new_a = _run_starts(a)
    tied_a = _tied_pairs(new_a)
    tied_b = _tied_pairs(_run_starts(np.sort(b)))
    tied_both = _tied_pairs(new_a | _run_starts(b))
    norm = float(np.sqrt(float(pairs - tied_a) * float(pairs - tied_b)))
    if not norm:
        return float("nan")
    discordant = _inversions(np.unique(b, return_inverse=True)[1])
    return (pairs - tied_a - tied_b + tied_both - 2 * discordant) / norm


def _run_starts(values: np.ndarray) -> np.ndarray:
    """Where each run of equal neighbours in ``values`` begins."""
    return np.concatenate(([True], values[1:] != values[:-1]))


def _tied_pairs(starts: np.ndarray) -> int:
    """Tied pairs of a sorted sequence, from where each run of equal values begins: a run of
    t counts t (t - 1) / 2."""
    runs = np.diff(np.flatnonzero(np.concatenate((starts, [True]))))
    return int((runs * (runs - 1) // 2).sum())


def _inversions(ranks: np.ndarray) -> int:
    """Pairs i < j with ranks[i] > ranks[j] (a Fenwick tree over the ranks)."""
    size = int(ranks.max()) + 1
    tree = [0] * (size + 1)
    count = 0
    for seen, rank in enumerate(ranks.tolist()):
        i = rank + 1  # how many seen so far are <= rank: the rest are inversions
        at_most = 0
        while i > 0:
            at_most += tree[i]
            i -= i & -i
        count += seen - at_most
        i = rank + 1
        while i <= size:
            tree[i] += 1
            i += i & -i
    return count


def predictor_options(
    name: str, options: dict[str, Any], defaults: dict[str, Any]
) -> dict[str, Any]:
    """``take_options`` for a predictor (its errors name the predictor)."""
    return take_options(f"length predictor {name}", options, defaults)
