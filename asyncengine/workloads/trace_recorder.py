"""TraceRecorder: writes a live trace (arrivals, finishes, measured steps, policy swaps) as the
engine runs, for replay in the simulator under other policies (scripts/compare_policies.py
--trace FILE) with a cost model fitted to the same run (--fit-from-trace). Format:
workloads/live_trace.py.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from asyncengine.common.plan import BatchPlan, StepFeatures
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.workloads.live_trace import VERSION, page_hashes, salt_digest

log = logging.getLogger("asyncengine.trace")

TRACE_FILE_MODE = 0o600

# recorded in their own fields, or meaningless to a replay
_OWN_FIELDS = frozenset({"priority", "tenant", "timeout", "lora", "cache_salt", "n"})
_DEFAULTS = {f.name: getattr(SamplingParams(), f.name) for f in fields(SamplingParams) if f.init}


def params_record(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that differ from the defaults (max_new_tokens always)."""
    if params.structured is not None and params.structured.parts:
        # the parts repeat what the spec holds (schemas to name on a compile error)
        params = replace(params, structured=replace(params.structured, parts=()))
    values = asdict(params)
    record = {
        k: v
        for k, v in values.items()
        if k in _DEFAULTS and k not in _OWN_FIELDS and v != _DEFAULTS[k]
    }
    record["max_new_tokens"] = params.max_new_tokens
    return record


class TraceRecorder:
    def __init__(
        self,
        path: str | Path,
        *,
        start: float,
        page_size: int,
        vocab_size: int,
        hashed: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.start = start
        self.page_size = page_size
        self.hashed = hashed
        self.lines = 0
        # 0600: a trace holds every prompt's token ids (or their page hashes)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, TRACE_FILE_MODE)
        os.fchmod(fd, TRACE_FILE_MODE)  # a file that was there keeps no wider mode
        self._file = open(fd, "w", encoding="utf-8", buffering=1)
        self._write(
            {
                "type": "header",
                "version": VERSION,
                "page_size": page_size,
                "vocab_size": vocab_size,
                "hashed": hashed,
                **(meta or {}),
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        if self._file.closed:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.lines += 1

    def arrival(self, req: Request, rid: str | None = None) -> None:
        """The arrival of the caller's request ``rid`` (default ``req.rid``) with all its
        choices: ``req`` is choice 0; each choice finishes under its own id (choice_rid)."""
        params = req.params
        record: dict[str, Any] = {
            "type": "arrival",
            "rid": req.rid if rid is None else rid,
            "time": req.arrival_time - self.start,
        }
        if self.hashed:
            record["page_hashes"] = page_hashes(req.prompt_ids, self.page_size)
            record["prompt_len"] = len(req.prompt_ids)
        else:
            record["prompt_ids"] = req.prompt_ids
        record["params"] = params_record(params)
        record["tenant"] = params.tenant
        record["priority"] = params.priority
        record["timeout"] = params.timeout
        if params.lora is not None:
            record["lora"] = params.lora
        if params.cache_salt is not None:
            salt = params.cache_salt
            record["cache_salt"] = salt_digest(salt) if self.hashed else salt
        if params.n != 1:
            record["n"] = params.n
        self._write(record)

    def finish(self, req: Request, now: float, reason: str | None = None) -> None:
        self._write(
            {
                "type": "finish",
                "rid": req.rid,
                "time": (req.finished_time or now) - self.start,
                "output_tokens": len(req.output_ids),
                "finish_reason": reason or req.finish_reason or "abort",
                "cached_tokens": req.cached_tokens,
            }
        )

    def step(self, plan: BatchPlan, seconds: float, now: float) -> None:
        features = StepFeatures.of_plan(plan)
        self._write(
            {"type": "step", "time": now - self.start, "seconds": seconds, **asdict(features)}
        )

    def policy_swap(self, spec: str, options: dict[str, Any], now: float) -> None:
        """A live swap to ``spec`` (with ``options``), so the trace says which policy ran
        which requests."""
        self._write(
            {"type": "policy", "time": now - self.start, "policy": spec, "options": options}
        )

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            log.info("trace of %d lines written to %s", self.lines, self.path)
