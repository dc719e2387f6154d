"""Seeded synthetic workloads (no downloads): the same arguments always give the same requests.

Prompts are token-id lists drawn from ``[0, vocab_size)``; ``text=True`` also attaches a
readable pseudo-word rendering of each prompt (``pseudo_text``) for text-only front ends.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import numpy as np

from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.trace import WorkloadRequest

_CONSONANTS = "bdfghjklmnprstvwyzcx"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 100 syllables: base-100 digits
_ARRIVAL_SEED_SALT = 0x5EED


def pseudo_text(token_ids: Sequence[int]) -> str:
    """One distinct pronounceable word per token id, so shared token prefixes stay shared text."""
    words = []
    for token in token_ids:
        syllables = [_SYLLABLES[token % 100]]
        token //= 100
        while token:
            syllables.append(_SYLLABLES[token % 100])
            token //= 100
        words.append("".join(syllables))
    return " ".join(words)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int
) -> list[int]:
    raw = rng.lognormal(math.log(median), sigma, size=n) if sigma > 0 else np.full(n, median)
    return np.clip(np.rint(raw), low, high).astype(np.int64).tolist()


def request_ids(name: str, n: int) -> list[str]:
    """``name-0 .. name-(n-1)``, zero-padded to one width (they sort in order)."""
    width = len(str(max(n - 1, 0)))
    return [f"{name}-{i:0{width}d}" for i in range(n)]


def _assemble(
    name: str,
    prompts: list[list[int]],
    output_lens: list[int],
    arrivals: Arrivals,
    seed: int,
    text: bool,
) -> list[WorkloadRequest]:
    times = arrivals.times(len(prompts), seed ^ _ARRIVAL_SEED_SALT)
    rids = request_ids(name, len(prompts))
    return [
        WorkloadRequest(
            rid=rids[i],
            arrival_time=times[i],
            prompt_ids=prompt,
            output_len=output_len,
            prompt_text=pseudo_text(prompt) if text else None,
        )
        for i, (prompt, output_len) in enumerate(zip(prompts, output_lens, strict=True))
    ]


def random_lengths(
    num_requests: int = 1000,
    *,
    vocab_size: int = 32000,
    input_median: float = 180.0,
    input_sigma: float = 1.0,
    output_median: float = 120.0,
    output_sigma: float = 0.9,
    min_input_len: int = 4,
    max_input_len: int = 2048,
    max_output_len: int = 1024,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Independent prompts with lognormal input/output lengths (a ShareGPT-like mix)."""
    rng = np.random.default_rng(seed)
    input_lens = _lognormal_lengths(
        rng, num_requests, input_median, input_sigma, min_input_len, max_input_len
    )
    output_lens = _lognormal_lengths(
        rng, num_requests, output_median, output_sigma, 1, max_output_len
    )
    prompts = [_tokens(rng, n, vocab_size) for n in input_lens]
    return _assemble("random", prompts, output_lens, arrivals or Arrivals(), seed, text)


def shared_prefix(
    num_groups: int = 8,
    questions_per_group: int = 32,
    *,
    vocab_size: int = 32000,
    prefix_len: int = 1024,
    question_median: float = 48.0,
    question_sigma: float = 0.5,
    max_question_len: int = 512,
    output_len: int = 64,
    shuffle: bool = True,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Few-shot serving: many short questions behind a few long shared prompts.

    With ``shuffle`` the groups interleave in arrival order, which is where prefix-aware
    policies (LPM, DFS-weight) earn their keep.
    """
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    total = num_groups * questions_per_group
    question_lens = _lognormal_lengths(
        rng, total, question_median, question_sigma, 1, max_question_len
    )
    prompts = [
        prefixes[i // questions_per_group] + _tokens(rng, question_lens[i], vocab_size)
        for i in range(total)
    ]
    if shuffle:
        prompts = [prompts[i] for i in rng.permutation(total)]
    return _assemble("prefix", prompts, [output_len] * total, arrivals or Arrivals(), seed, text)


def multi_turn(
    num_conversations: int = 32,
    num_turns: int = 4,
    *,
    vocab_size: int = 32000,
    system_len: int = 64,
    user_median: float = 48.0,
    user_sigma: float = 0.5,
    max_user_len: int = 512,
    output_len: int = 64,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Chat sessions: turn k's prompt = turn k-1's prompt + its answer + a new user message.

    Every conversation starts with the same system prompt. Requests are ordered turn by turn
    (all first turns, then all second turns, ...), so a later turn always arrives later. The
    previous answer is a synthetic token sequence of ``output_len`` tokens: the engine's own
    answer differs, so only the prompt part can be reused from the cache.
    """
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab_size)
    histories = [list(system) for _ in range(num_conversations)]
    prompts: list[list[int]] = []
    for _turn in range(num_turns):
        user_lens = _lognormal_lengths(
            rng, num_conversations, user_median, user_sigma, 1, max_user_len
        )
        for conversation, user_len in zip(histories, user_lens, strict=True):
            conversation.extend(_tokens(rng, user_len, vocab_size))
            prompts.append(list(conversation))
            conversation.extend(_tokens(rng, output_len, vocab_size))  # this turn's answer
    return _assemble(
        "chat", prompts, [output_len] * len(prompts), arrivals or Arrivals(), seed, text
    )


def tree_of_thought(
    num_trees: int = 4,
    depth: int = 3,
    branching: int = 3,
    *,
    vocab_size: int = 32000,
    root_len: int = 256,
    branch_len: int = 64,
    output_len: int = 32,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Branching reasoning: every node is a request whose prompt = parent's prompt + a segment.

    Each tree has ``sum(branching**d for d in 0..depth)`` nodes. Requests are ordered level by
    level across all trees (all roots, then every first-level branch, ...), as a breadth-first
    search would issue them.
    """
    rng = np.random.default_rng(seed)
    level = [_tokens(rng, root_len, vocab_size) for _ in range(num_trees)]
    prompts: list[list[int]] = list(level)
    for _ in range(depth):
        level = [
            parent + _tokens(rng, branch_len, vocab_size)
            for parent in level
            for _ in range(branching)
        ]
        prompts.extend(level)
    return _assemble(
        "tot", prompts, [output_len] * len(prompts), arrivals or Arrivals(), seed, text
    )


def long_short(
    num_requests: int = 64,
    *,
    vocab_size: int = 32000,
    short_len: int = 32,
    long_factor: int = 64,
    output_len: int = 32,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Three short prompts then one ``long_factor`` times longer, repeating, one every 20 ms.

    The head-of-line blocking test: without chunked prefill the long prompts stall the short
    requests' decodes (ITL spikes).
    """
    rng = np.random.default_rng(seed)
    lens = [short_len * long_factor if i % 4 == 3 else short_len for i in range(num_requests)]
    prompts = [_tokens(rng, n, vocab_size) for n in lens]
    arrivals = arrivals or Arrivals("interval", interval=0.02)
    return _assemble("longshort", prompts, [output_len] * num_requests, arrivals, seed, text)


# task mix: (tenant, weight, prompt median, output median) of each kind of request
TASKS = (
    ("classify", 0.3, 300.0, 4.0),
    ("summarize", 0.2, 1200.0, 120.0),
    ("chat", 0.3, 150.0, 250.0),
    ("code", 0.2, 100.0, 600.0),
)


def task_mix(
    num_requests: int = 1000,
    *,
    vocab_size: int = 32000,
    template_len: int = 24,
    sigma: float = 0.5,
    max_input_len: int = 4096,
    max_output_len: int = 2048,
    arrivals: Arrivals | None = None,
    seed: int = 0,
    text: bool = False,
) -> list[WorkloadRequest]:
    """Four kinds of request (``TASKS``) whose output lengths differ by kind, as a deployment
    serving several applications sees: classification (long-ish prompt, a few tokens out),
    summaries (long prompt, short answer), chat, code (short prompt, long answer). Each kind's
    prompts start with its own ``template_len``-token instruction and carry its name as the
    tenant; lengths are lognormal around the kind's medians. What an output-length predictor
    can learn from cheap prompt features (policies/length_history.py, length_ranker.py)."""
    rng = np.random.default_rng(seed)
    weights = np.array([t[1] for t in TASKS])
    kinds = rng.choice(len(TASKS), size=num_requests, p=weights / weights.sum())
    templates = [_tokens(rng, template_len, vocab_size) for _ in TASKS]
    prompts, output_lens = [], []
    for kind in kinds.tolist():
        _, _, prompt_median, output_median = TASKS[kind]
        (body,) = _lognormal_lengths(rng, 1, prompt_median, sigma, 1, max_input_len)
        (out,) = _lognormal_lengths(rng, 1, output_median, sigma, 1, max_output_len)
        prompts.append(templates[kind] + _tokens(rng, body, vocab_size))
        output_lens.append(out)
    requests = _assemble("task", prompts, output_lens, arrivals or Arrivals(), seed, text)
    for req, kind in zip(requests, kinds.tolist(), strict=True):
        req.tenant = TASKS[kind][0]
    return requests


WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "random": random_lengths,
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "tree_of_thought": tree_of_thought,
    "long_short": long_short,
    "task_mix": task_mix,
}


def make_workload(name: str, **kwargs: object) -> list[WorkloadRequest]:
    """Build a named workload; keyword arguments go to its generator (ValueError naming the
    generator's arguments when one is not among them)."""
    try:
        generator = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    known = inspect.signature(generator).parameters
    unknown = sorted(set(kwargs) - set(known))
    if unknown == ["arrivals"]:
        rates = [arg for arg in known if "rate" in arg]
        raise ValueError(
            f"workload {name!r} draws its own arrival times and takes no 'arrivals' (--arrivals)"
            + (f": set its {', '.join(rates)} instead" if rates else "")
        )
    if unknown:
        raise ValueError(
            f"workload {name!r} takes no argument {', '.join(map(repr, unknown))}; "
            f"its arguments: {', '.join(known)}"
        )
    return generator(**kwargs)
