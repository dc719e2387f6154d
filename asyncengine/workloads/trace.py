"""WorkloadRequest and JSONL traces (one request per line, exact round trip)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncengine.common.cache_salt import salted_ids
from asyncengine.common.request import choice_rid


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a replayable workload.

    ``arrival_time`` is in seconds relative to the start of the run. ``output_len`` is the
    exact number of tokens to generate (``max_new_tokens`` with ``ignore_eos``). ``priority``,
    ``tenant`` and ``timeout`` are the request's scheduling controls (SamplingParams).
    ``acceptance``: for the simulator, the chance that each speculative guess of this request
    is accepted (None: its guesses are all rejected there); a live run measures it per request
    (usage ``accepted_speculative_tokens``). ``lora``: the LoRA adapter it runs under (None:
    the base model). ``cache_salt``: its prefix-cache namespace (SamplingParams.cache_salt).
    ``n``: its choices, each generating ``output_len`` tokens; choices 1..n-1 fork choice 0's
    prompt pages, as the engine runs them (ids ``choice_rids``).
    """

    rid: str
    arrival_time: float
    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None
    priority: int = 0
    tenant: str | None = None
    timeout: float | None = None
    acceptance: float | None = None
    lora: str | None = None
    cache_salt: str | None = None
    n: int = 1

    @property
    def choice_rids(self) -> list[str]:
        """The ids its choices run under, choice 0 first."""
        return [choice_rid(self.rid, self.n, i) for i in range(self.n)]

    @property
    def cache_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it (under its salt and adapter)."""
        return salted_ids(self.prompt_ids, self.cache_salt, self.lora)

    def to_json(self) -> dict[str, object]:
        record: dict[str, object] = {
            "rid": self.rid,
            "arrival_time": self.arrival_time,
            "prompt_ids": self.prompt_ids,
            "output_len": self.output_len,
        }
        if self.prompt_text is not None:
            record["prompt_text"] = self.prompt_text
        if self.priority:
            record["priority"] = self.priority
        if self.tenant is not None:
            record["tenant"] = self.tenant
        if self.timeout is not None:
            record["timeout"] = self.timeout
        if self.acceptance is not None:
            record["acceptance"] = self.acceptance
        if self.lora is not None:
            record["lora"] = self.lora
        if self.cache_salt is not None:
            record["cache_salt"] = self.cache_salt
        if self.n != 1:
            record["n"] = self.n
        return record

    @classmethod
    def from_json(cls, record: dict[str, object]) -> WorkloadRequest:
        prompt_ids = record["prompt_ids"]
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise ValueError(f"request {record.get('rid')!r}: prompt_ids must be a list of ints")
        text = record.get("prompt_text")
        tenant = record.get("tenant")
        timeout = record.get("timeout")
        acceptance = record.get("acceptance")
        lora = record.get("lora")
        rid = record.get("rid")
        if any(isinstance(t, bool) or t < 0 for t in prompt_ids):
            raise ValueError(f"request {rid!r}: prompt_ids must be token ids >= 0")
        arrival = record["arrival_time"]
        if isinstance(arrival, bool) or not isinstance(arrival, int | float):
            raise ValueError(f"request {rid!r}: arrival_time must be a number of seconds")
        if not math.isfinite(arrival) or arrival < 0:  # a NaN never arrives: a run waits forever
            raise ValueError(
                f"request {rid!r}: arrival_time must be finite and >= 0, got {arrival}"
            )
        output_len = record["output_len"]
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 0:
            raise ValueError(f"request {rid!r}: output_len must be a whole number >= 0")
        n = record.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"request {rid!r}: n must be a whole number >= 1")
        salt = record.get("cache_salt")
        return cls(
            rid=str(record["rid"]),
            arrival_time=float(arrival),
            prompt_ids=prompt_ids,
            output_len=output_len,
            prompt_text=None if text is None else str(text),
            priority=int(record.get("priority", 0)),  # type: ignore[call-overload]
            tenant=None if tenant is None else str(tenant),
            timeout=None if timeout is None else float(timeout),  # type: ignore[arg-type]
            acceptance=None if acceptance is None else float(acceptance),  # type: ignore[arg-type]
            lora=None if lora is None else str(lora),
            cache_salt=None if salt is None else str(salt),
            n=n,
        )


def save_trace(path: str | Path, requests: Iterable[WorkloadRequest]) -> None:
    """Write one JSON object per line. Floats use repr, so loading gives back the same values."""
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_json(), separators=(",", ":")))
            f.write("\n")


def load_trace(path: str | Path) -> list[WorkloadRequest]:
    """Read a trace written by ``save_trace`` (blank lines are ignored)."""
    requests: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(WorkloadRequest.from_json(json.loads(line)))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: bad trace line: {exc}") from exc
    return requests
