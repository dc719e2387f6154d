"""CompactWorkload: a workload held as numpy arrays, its requests made one at a time.

A million requests as ``WorkloadRequest`` objects hold every prompt token as a Python int in
a list (~9 KB a request: ~9 GB). Here the prompts are one int32 array with each request's
start, and the arrival times, output lengths and scheduling controls are columns: ~1 KB a
request for the ``random`` mix. It is a ``Sequence[WorkloadRequest]``: indexing builds the
request (its prompt a fresh list), so everything that takes a workload takes it; the
simulator's replay (sim/workload_replay.py) reads the columns directly and makes each request
only when it arrives.

``random_compact`` draws exactly the requests of ``random_lengths`` (the same seed gives the
same prompts, lengths and arrival times; tests/workloads/test_compact_workload.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from asyncengine.workloads.arrivals import Arrivals

# the list generator's draws: one place for them, so both forms give the same requests
from asyncengine.workloads.generators import _ARRIVAL_SEED_SALT, _lognormal_lengths, request_ids
from asyncengine.workloads.trace import WorkloadRequest

_INT32_MAX = 2**31 - 1


@dataclass(slots=True, eq=False)
class CompactWorkload(Sequence[WorkloadRequest]):
    """Request ``i``: ``rids[i]``, arriving at ``arrival_times[i]``, prompt
    ``tokens[starts[i]:starts[i + 1]]``, ``output_lens[i]`` tokens to generate; ``priorities``,
    ``tenants`` and ``timeouts`` (NaN: none) are None when no request sets them. No prompt
    text and no speculative acceptance (keep such workloads as lists)."""

    rids: list[str]
    arrival_times: np.ndarray  # float64
    starts: np.ndarray  # int64, one more than the requests
    tokens: np.ndarray  # int32 (int64 for ids past int32)
    output_lens: np.ndarray  # int64
    priorities: np.ndarray | None = None  # int64
    tenants: list[str | None] | None = None
    timeouts: np.ndarray | None = None  # float64, NaN: no timeout

    def __post_init__(self) -> None:
        n = len(self.rids)
        columns = [self.arrival_times, self.output_lens, self.priorities, self.timeouts]
        if len(self.starts) != n + 1 or any(c is not None and len(c) != n for c in columns):
            raise ValueError(f"compact workload columns disagree with its {n} requests")
        if self.tenants is not None and len(self.tenants) != n:
            raise ValueError(f"compact workload tenants disagree with its {n} requests")
        if n and (self.starts[0] != 0 or self.starts[-1] != len(self.tokens)):
            raise ValueError("compact workload starts do not cover its tokens")

    def __len__(self) -> int:
        return len(self.rids)

    @overload
    def __getitem__(self, index: int) -> WorkloadRequest: ...

    @overload
    def __getitem__(self, index: slice) -> list[WorkloadRequest]: ...

    def __getitem__(self, index: int | slice) -> WorkloadRequest | list[WorkloadRequest]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"request {index} of a {len(self)}-request workload")
        return WorkloadRequest(
            rid=self.rids[index],
            arrival_time=float(self.arrival_times[index]),
            prompt_ids=self.prompt(index),
            output_len=int(self.output_lens[index]),
            priority=self.priority(index),
            tenant=None if self.tenants is None else self.tenants[index],
            timeout=self.timeout(index),
        )

    def __iter__(self) -> Iterator[WorkloadRequest]:
        for i in range(len(self)):
            yield self[i]

    def prompt(self, index: int) -> list[int]:
        """Request ``index``'s prompt, a fresh list of Python ints."""
        prompt: list[int] = self.tokens[self.starts[index] : self.starts[index + 1]].tolist()
        return prompt

    def prompt_lens(self) -> np.ndarray:
        lens: np.ndarray = np.diff(self.starts)
        return lens

    def priority(self, index: int) -> int:
        return 0 if self.priorities is None else int(self.priorities[index])

    def timeout(self, index: int) -> float | None:
        if self.timeouts is None:
            return None
        value = float(self.timeouts[index])
        return None if math.isnan(value) else value

    def by_arrival(self) -> CompactWorkload:
        """The same requests in arrival order (ties in place order); itself when they are."""
        times = self.arrival_times
        if len(times) < 2 or bool(np.all(times[1:] >= times[:-1])):
            return self
        order = np.argsort(times, kind="stable")
        lens = self.prompt_lens()[order]
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        # token t of the new layout comes from its request's old start + its offset in it
        source = np.repeat(self.starts[:-1][order] - starts[:-1], lens) + np.arange(starts[-1])
        return CompactWorkload(
            rids=[self.rids[i] for i in order.tolist()],
            arrival_times=times[order],
            starts=starts,
            tokens=self.tokens[source],
            output_lens=self.output_lens[order],
            priorities=None if self.priorities is None else self.priorities[order],
            tenants=None if self.tenants is None else [self.tenants[i] for i in order.tolist()],
            timeouts=None if self.timeouts is None else self.timeouts[order],
        )

    @classmethod
    def from_requests(cls, requests: Sequence[WorkloadRequest]) -> CompactWorkload:
        """The same requests held as arrays (ValueError for prompt text, acceptance or an
        adapter)."""
        for item in requests:
            if item.prompt_text is not None or item.acceptance is not None or item.lora:
                raise ValueError(
                    f"request {item.rid!r}: a compact workload holds no prompt text, "
                    f"speculative acceptance or LoRA adapter"
                )
        lens = np.fromiter((len(item.prompt_ids) for item in requests), np.int64, len(requests))
        starts = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        largest = max((max(item.prompt_ids, default=0) for item in requests), default=0)
        tokens = np.empty(int(starts[-1]), dtype=_token_dtype(largest + 1))
        for i, item in enumerate(requests):
            tokens[starts[i] : starts[i + 1]] = item.prompt_ids
        priorities = [item.priority for item in requests]
        tenants = [item.tenant for item in requests]
        timeouts = [item.timeout for item in requests]
        return cls(
            rids=[item.rid for item in requests],
            arrival_times=np.array([item.arrival_time for item in requests], dtype=np.float64),
            starts=starts,
            tokens=tokens,
            output_lens=np.array([item.output_len for item in requests], dtype=np.int64),
            priorities=np.array(priorities, dtype=np.int64) if any(priorities) else None,
            tenants=tenants if any(t is not None for t in tenants) else None,
            timeouts=(
                np.array([math.nan if t is None else t for t in timeouts], dtype=np.float64)
                if any(t is not None for t in timeouts)
                else None
            ),
        )


def _token_dtype(vocab_size: int) -> type[np.signedinteger]:
    return np.int32 if vocab_size - 1 <= _INT32_MAX else np.int64


def random_compact(
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
) -> CompactWorkload:
    """``random_lengths``'s requests (the same arguments, the same draws), as arrays."""
    rng = np.random.default_rng(seed)
    input_lens = _lognormal_lengths(
        rng, num_requests, input_median, input_sigma, min_input_len, max_input_len
    )
    output_lens = _lognormal_lengths(
        rng, num_requests, output_median, output_sigma, 1, max_output_len
    )
    starts = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(input_lens, out=starts[1:])
    tokens = np.empty(int(starts[-1]), dtype=_token_dtype(vocab_size))
    for i, n in enumerate(input_lens):  # one draw per prompt, as _tokens draws them
        tokens[starts[i] : starts[i + 1]] = rng.integers(0, vocab_size, size=n)
    times = (arrivals or Arrivals()).times(num_requests, seed ^ _ARRIVAL_SEED_SALT)
    return CompactWorkload(
        rids=request_ids("random", num_requests),
        arrival_times=np.array(times, dtype=np.float64),
        starts=starts,
        tokens=tokens,
        output_lens=np.array(output_lens, dtype=np.int64),
    )
