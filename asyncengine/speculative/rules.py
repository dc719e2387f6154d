"""How many guesses a request gets this step: the built-in rules behind ``Policy.speculate``.

"fixed": the configured ``num_speculative_tokens``.
"adaptive": guess j is worth verifying while the chance that guesses 1..j are all accepted,
estimated as rate ** j from the request's acceptance so far, exceeds what verifying one more
token costs, as a share of a step: ``FLOOR_CHANCE`` plus batch size / ``max_verify_tokens``
(a step's cost hardly grows with its tokens while it is bound by reading the weights, and grows
with every token once it is compute bound, which ``max_verify_tokens`` marks); and a step never
verifies more than ``max_verify_tokens`` tokens over its decodes. A request whose guesses keep failing gets none, except a one-token probe
every ``PROBE_EVERY`` tokens, so that text turning repetitive later is noticed.
"""

from __future__ import annotations

from asyncengine.common.request import Request
from asyncengine.speculative.settings import SpeculativeConfig

FLOOR_CHANCE = 0.05
PROBE_EVERY = 16
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
    guesses, chance = 0, 1.0
    while guesses < limit:
        chance *= rate
        if chance < worth:
            break
        guesses += 1
    if guesses == 0 and len(req.output_ids) % PROBE_EVERY == 0:
        return 1
    return guesses


def rule_guesses(settings: SpeculativeConfig, req: Request, batch_size: int) -> int:
    """The configured rule's guesses for ``req``."""
    if settings.rule == "fixed":
        return settings.num_speculative_tokens
    return adaptive_guesses(settings, req, batch_size)
