"""Live traces: what ``asyncengine serve --record-trace FILE`` writes, and reading it back as a
replayable workload plus the measured steps (for fitting a cost model to the same run).

One JSON object per line, each with a ``type``:

- ``header``: ``version``, ``page_size``, ``vocab_size``, ``hashed``, ``model``, ``policy``
  and ``policy_options`` (the policy recording began under);
- ``policy``: ``time``, ``policy``, ``options``: a live swap (``/admin/policy``); the requests
  scheduled after it ran under that policy, until the next one;
- ``arrival``: ``rid``, ``time`` (seconds since recording began), ``prompt_ids`` (or, when
  hashed, ``page_hashes`` and ``prompt_len``), ``params`` (the sampling parameters that differ
  from the defaults), ``tenant``, ``priority``, ``timeout``, ``lora`` (the adapter, when one),
  ``cache_salt`` (when one; hashed in a hashed trace) and ``n`` (when more than one choice);
- ``finish``: ``rid`` (a choice's: ``<rid>-<i>`` when n > 1), ``time``, ``output_tokens``,
  ``finish_reason``, ``cached_tokens``;
- ``step``: ``time``, ``seconds`` (measured forward time) and the step's cost-model features
  ``prefill_tokens``, ``prefill_attention``, ``decode_requests``, ``decode_context``.

Hashed traces keep no token: a prompt is the chain of its whole pages' hashes (each hashes the
previous one and the page's tokens) and its length. Read back, each page hash becomes the same
pseudo-random page of tokens wherever it occurs and the partial last page fresh tokens, so the
prefix cache, which shares whole pages only, sees exactly the sharing of the live run. A salt is
kept as its digest: distinct salts stay distinct, so the cache sees the same namespaces.

A request with n choices is one arrival (replayed as n choices that fork choice 0's prompt
pages, as the engine runs them); each choice generates the longest choice's length. Version 1
traces wrote an arrival per choice and no top-level ``cache_salt``: they load as before, with
the salt read from ``params``. Version 3 added the ``policy`` records.

Replay lengths: a request that finished by stop or length generates what it generated live
(ignoring EOS); one that timed out asks for its ``max_new_tokens``; an aborted one generates
what it got before the abort (at least one token).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncengine.common.request import choice_rid
from asyncengine.workloads.trace import WorkloadRequest, load_trace

VERSION = 3
HASH_BYTES = 8


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[str]:
    """Chained hashes of the whole pages of ``token_ids`` (hex, one per page)."""
    hashes: list[str] = []
    previous = b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = np.asarray(token_ids[start : start + page_size], dtype=np.int64).tobytes()
        previous = hashlib.blake2b(previous + page, digest_size=HASH_BYTES).digest()
        hashes.append(previous.hex())
    return hashes


def salt_digest(salt: str) -> str:
    """A hashed trace's stand-in for a cache salt: equal for equal salts, and nothing more."""
    return hashlib.blake2b(salt.encode(), digest_size=HASH_BYTES, person=b"trace-salt").hexdigest()


def tokens_of_hashes(
    hashes: Sequence[str], prompt_len: int, page_size: int, vocab_size: int, salt: str
) -> list[int]:
    """Pseudo-random tokens with the page sharing ``hashes`` describe (see the module notes)."""
    tokens: list[int] = []
    for digest in hashes:
        rng = np.random.default_rng(int(digest, 16))
        tokens.extend(rng.integers(1, vocab_size, size=page_size).tolist())
    tail = prompt_len - len(tokens)
    if tail < 0 or tail >= page_size:
        raise ValueError(f"{len(hashes)} page hashes do not describe {prompt_len} tokens")
    if tail:
        seed = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big")
        tokens.extend(np.random.default_rng(seed).integers(1, vocab_size, size=tail).tolist())
    return tokens


@dataclass(slots=True)
class StepRecord:
    time: float
    seconds: float
    prefill_tokens: int
    prefill_attention: int
    decode_requests: int
    decode_context: int


@dataclass(frozen=True, slots=True)
class PolicySwap:
    """A live policy swap: from ``time`` on, ``policy`` with ``options`` scheduled."""

    time: float
    policy: str
    options: dict[str, Any]


@dataclass(slots=True)
class LiveTrace:
    header: dict[str, Any]
    requests: list[WorkloadRequest] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    # the live swaps in time order (a replay runs the policies it is asked to compare)
    policy_swaps: list[PolicySwap] = field(default_factory=list)


def is_live_trace(path: str | Path) -> bool:
    """Whether ``path`` is a live trace (its first line is a header) rather than a workload."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and first.get("type") == "header"
    return False


def _output_len(arrival: dict[str, Any], finish: dict[str, Any] | None) -> int:
    asked = int(arrival.get("params", {}).get("max_new_tokens", 128))
    if finish is None:
        return asked
    reason = finish.get("finish_reason")
    produced = int(finish.get("output_tokens", 0))
    if reason in ("stop", "length"):
        return max(produced, 1)
    if reason == "timeout":
        return asked
    return max(produced, 1)


def load_live_trace(path: str | Path) -> LiveTrace:
    """Read a live trace; requests come back in arrival order with their scheduling controls."""
    header: dict[str, Any] | None = None
    arrivals: list[dict[str, Any]] = []
    finishes: dict[str, dict[str, Any]] = {}
    steps: list[StepRecord] = []
    swaps: list[PolicySwap] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                kind = record["type"]
                if kind == "header":
                    header = record
                elif kind == "arrival":
                    arrivals.append(record)
                elif kind == "finish":
                    finishes[str(record["rid"])] = record
                elif kind == "step":
                    steps.append(
                        StepRecord(
                            float(record["time"]),
                            float(record["seconds"]),
                            int(record["prefill_tokens"]),
                            int(record["prefill_attention"]),
                            int(record["decode_requests"]),
                            int(record["decode_context"]),
                        )
                    )
                elif kind == "policy":
                    options = record["options"]
                    if not isinstance(options, dict):
                        raise ValueError(f"policy options must be an object, got {options!r}")
                    swaps.append(PolicySwap(float(record["time"]), str(record["policy"]), options))
                else:
                    raise ValueError(f"unknown record type {kind!r}")
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: bad live-trace line: {exc}") from exc
    if header is None:
        raise ValueError(f"{path}: not a live trace (no header line)")
    page_size = int(header["page_size"])
    vocab = int(header.get("vocab_size", 32000))
    trace = LiveTrace(header, steps=steps, policy_swaps=sorted(swaps, key=lambda s: s.time))
    seen: dict[str, int] = {}
    for arrival in sorted(arrivals, key=lambda a: float(a["time"])):
        rid = str(arrival["rid"])
        seen[rid] = seen.get(rid, 0) + 1
        unique = rid if seen[rid] == 1 else f"{rid}#{seen[rid]}"  # ids may be reused live
        if "prompt_ids" in arrival:
            prompt = [int(t) for t in arrival["prompt_ids"]]
        else:
            prompt = tokens_of_hashes(
                arrival["page_hashes"], int(arrival["prompt_len"]), page_size, vocab, unique
            )
        n = int(arrival.get("n", 1))
        if n < 1:
            raise ValueError(f"{path}: request {rid!r} has n={n}")
        output_len = 0
        for i in range(n):
            finish = finishes.get(choice_rid(rid, n, i))
            if finish is not None:
                trace.finish_reasons[choice_rid(unique, n, i)] = str(finish.get("finish_reason"))
            output_len = max(output_len, _output_len(arrival, finish))
        timeout = arrival.get("timeout")
        salt = arrival.get("cache_salt", arrival.get("params", {}).get("cache_salt"))
        trace.requests.append(
            WorkloadRequest(
                rid=unique,
                arrival_time=float(arrival["time"]),
                prompt_ids=prompt,
                output_len=output_len,
                priority=int(arrival.get("priority", 0)),
                tenant=arrival.get("tenant"),
                timeout=None if timeout is None else float(timeout),
                lora=arrival.get("lora"),
                cache_salt=None if salt is None else str(salt),
                n=n,
            )
        )
    return trace


def load_requests(path: str | Path) -> list[WorkloadRequest]:
    """The requests of a workload trace (``save_trace``) or of a live trace."""
    return load_live_trace(path).requests if is_live_trace(path) else load_trace(path)
