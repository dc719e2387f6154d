"""Which running request to retract when KV memory runs short: the built-in victim rules.

``preemption_victim`` (engine config) names one; ``Policy.preempt_candidates(None, ...)``
orders the running requests by it unless a policy says otherwise. First in the list goes first.

- ``newest``: fewest output tokens (the request admitted last loses least decode progress),
  ties the longest prompt (its prefix is likeliest to stay cached) — the engine's old rule;
- ``least-computed``: fewest tokens with KV written (prompt + outputs): least work to redo;
- ``lowest-priority``: the worst ``priority`` (largest value) first, ties as ``newest``;
- ``largest-kv``: most KV of its own (tokens not in the prefix cache, whose pages retracting
  it frees at once): the most memory per victim, so the fewest requests are preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncengine.common.request import Request


def _newest(req: Request) -> tuple[float, ...]:
    return (len(req.output_ids), -len(req.prompt_ids))


def _least_computed(req: Request) -> tuple[float, ...]:
    return (req.kv_len, len(req.output_ids))


def _lowest_priority(req: Request) -> tuple[float, ...]:
    return (-req.params.priority, len(req.output_ids), -len(req.prompt_ids))


def _largest_kv(req: Request) -> tuple[float, ...]:
    seq = req.seq
    own = 0 if seq is None else seq.kv_len - seq.num_in_tree  # tokens in pages of its own
    return (-own, len(req.output_ids))


VICTIM_RULES: dict[str, Callable[[Request], tuple[float, ...]]] = {
    "newest": _newest,
    "least-computed": _least_computed,
    "lowest-priority": _lowest_priority,
    "largest-kv": _largest_kv,
}


def order_victims(rule: str, running: Sequence[Request]) -> list[Request]:
    """``running`` in the order ``rule`` retracts them (first: the first victim)."""
    try:
        key = VICTIM_RULES[rule]
    except KeyError:
        raise ValueError(
            f"unknown preemption victim rule {rule!r}; known: {', '.join(VICTIM_RULES)}"
        ) from None
    return sorted(running, key=key)
