"""How many guesses a request gets this step: the built-in rules behind ``Policy.speculate``.

"fixed": the configured ``num_speculative_tokens``.
"adaptive": guess j is worth verifying while the chance that guesses 1..j are all accepted,
estimated as rate ** j from the request's acceptance so far, exceeds what verifying one more
token costs, as a share of a step: ``FLOOR_CHANCE`` plus batch size / ``max_verify_tokens``
(a step's cost hardly grows with its tokens while it is bound by reading the weights, and grows
with every token once it is compute bound, which ``max_verify_tokens`` marks); and a step never
verifies more than ``max_verify_tokens`` tokens over its decodes. The guesses are then only
made when the tokens they are expected to gain, less their cost, exceed ``verify_overhead``:
what a step that verifies costs beyond a plain decode step, as a share of one (on the CPU a
verify step runs the extend path, not the one-call native decode: measured 0.6-0.7 at batch
1). A request whose guesses keep failing gets none, except a one-token probe now and then, so
that text turning repetitive later is noticed: every ``PROBE_EVERY`` tokens, or less often
when a failed probe costs more than ``PROBE_SHARE`` of the steps between probes.
"""

from __future__ import annotations

import math

from asyncengine.request import Request
from asyncengine.speculative.settings import SpeculativeConfig

FLOOR_CHANCE = 0.05
PROBE_EVERY = 16
PROBE_SHARE = 0.02
# a request's rate starts as if PRIOR_ACCEPTED of PRIOR_PROPOSED guesses were accepted
PRIOR_ACCEPTED = 3
PRIOR_PROPOSED = 4


def acceptance_rate(req: Request) -> float:
    """The request's acceptance rate so far, pulled towards an optimistic prior."""
    return (req.accepted_guesses + PRIOR_ACCEPTED) / (req.proposed_guesses + PRIOR_PROPOSED)


def adaptive_guesses(settings: SpeculativeConfig, req: Request, batch_size: int) -> int:
    """The adaptive rule (module docstring) for ``req`` in a step of ``batch_size`` requests."""
    limit = min(
        settings.num_speculative_tokens, settings.max_verify_tokens // max(1, batch_size) - 1
    )
    if limit <= 0:
        return 0
    rate = acceptance_rate(req)
    worth = FLOOR_CHANCE + batch_size / settings.max_verify_tokens
    guesses, chance, gain = 0, 1.0, 0.0
    while guesses < limit:
        chance *= rate
        if chance < worth:
            break
        guesses += 1
        gain += chance - worth
    if guesses and gain > settings.verify_overhead:
        return guesses
    probe_every = max(PROBE_EVERY, math.ceil((settings.verify_overhead + worth) / PROBE_SHARE))
    if len(req.output_ids) % probe_every == 0:
        return 1
    return 0


def rule_guesses(settings: SpeculativeConfig, req: Request, batch_size: int) -> int:
    """The configured rule's guesses for ``req``."""
    if settings.rule == "fixed":
        return settings.num_speculative_tokens
    return adaptive_guesses(settings, req, batch_size)
