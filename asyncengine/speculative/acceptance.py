"""Which guesses a verified row keeps.

The runner samples a token at each of a row's ``1 + len(guesses)`` positions, position j under
the row's sampling state as if guesses[:j] had been accepted (penalties, seed step, grammar
mask). The row keeps guesses while each equals the token sampled before it, then the first
token that differs (or the one after the last guess): ``sampled[:accepted + 1]``.

Greedy rows: the argmax at each position, so the output is token for token what decoding one
token per step gives. Sampled rows: a prompt-lookup guess is a point mass q(g) = 1, for which
standard speculative (rejection) sampling accepts g with probability p(g) and otherwise draws
from p with g removed and renormalised. Drawing x ~ p and accepting g iff x == g is exactly
that: P(accept) = p(g), and a rejected draw is p conditioned on x != g. The draw at each
position uses the same uniform a one-token step would have (a seed's uniform depends on the
number of tokens generated before it), so a seeded request samples the same tokens with or
without speculation, whatever its guesses were.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(guesses: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading ``guesses`` agree with the tokens ``sampled`` at the positions before
    them (``len(sampled) == len(guesses) + 1``)."""
    if len(sampled) != len(guesses) + 1:
        raise ValueError(f"{len(guesses)} guesses need {len(guesses) + 1} sampled tokens")
    accepted = 0
    for guess, token in zip(guesses, sampled, strict=False):
        if guess != token:
            break
        accepted += 1
    return accepted
