"""Fuzz every endpoint of a live server with bodies generated from its own /openapi.json.

    .venv/bin/python scripts/fuzz_api.py --examples 200            # the tiny random model
    .venv/bin/python scripts/fuzz_api.py --model smollm2-135m --examples 50

A server (engine + app, admin routes on) runs on 127.0.0.1 in a background thread; schemathesis
turns the document into valid ("positive") and invalid ("negative") requests for each
operation and sends them over loopback. A request fails the run when it is answered >= 500,
when a 4xx body is not the JSON error ``{"error": {"message": ...}}``, or when a stream carries
a server error in-band. After the fuzzing the server must still answer a plain chat request,
go idle, and hold no KV page outside the prefix cache (the pool invariant checked). Prints a
table per operation and writes the figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADMIN_TOKEN = "fuzz-admin"
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(slots=True)
class OperationFigures:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # 4xx by the param they name
    seconds: float = 0.0


@dataclass(slots=True)
class FuzzReport:
    operations: dict[str, OperationFigures] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[dict[str, Any]] = field(default_factory=list)  # 200s that ended "abort"
    serving_after: bool = False
    leak_check: str = "not run"

    @property
    def requests(self) -> int:
        return sum(op.requests for op in self.operations.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "failures": self.failures,
            "aborted": self.aborted,
            "serving_after": self.serving_after,
            "leak_check": self.leak_check,
            "operations": {
                name: {
                    "requests": op.requests,
                    "statuses": {str(k): v for k, v in sorted(op.statuses.items())},
                    "refusals": dict(op.refusals.most_common()),
                    "seconds": round(op.seconds, 2),
                }
                for name, op in self.operations.items()
            },
        }


def tiny_model(directory: Path) -> Path:
    """A tiny random llama with the default model's tokenizer (fast to fuzz)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model

    default_dir = resolve_model(DEFAULT_MODEL, torch.bfloat16)
    config = LlamaConfig(**TINY_LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (default_dir / name).is_file():
            shutil.copy(default_dir / name, directory / name)
    return directory


class BackgroundServer:
    """An engine and the app on 127.0.0.1 in a thread with its own event loop."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.engine: Any = None
        self.runner: Any = None
        self.port = 0

    def start(self) -> str:
        self.thread.start()
        self.call(self._start())
        return f"http://127.0.0.1:{self.port}"

    def call(self, coroutine: Any, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self) -> None:
        from asyncengine.engine import AsyncEngine
        from asyncengine.server.app import create_app
        from asyncengine.server.serve import start_http

        self.engine = AsyncEngine(self.config)
        await self.engine.start()
        app = create_app(self.engine, admin_token=ADMIN_TOKEN)
        self.runner, self.port = await start_http(app, "127.0.0.1", 0, shutdown_grace=2.0)

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.engine.stop()

    async def leak_check(self, timeout: float = 60.0) -> str:
        """ "ok", or what is wrong: the engine must go idle with no page held by a request."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            idle = stats["running"] == stats["prefilling"] == stats["waiting"] == 0
            if idle and stats["pages_used"] == 0:
                break
            if time.monotonic() > deadline:
                return f"not idle after {timeout:.0f} s: {stats}"
            await asyncio.sleep(0.05)
        if stats["pages_free"] + stats["pages_cached"] != stats["pages_total"]:
            return f"pages unaccounted for: {stats}"
        try:
            self.engine.scheduler.kv.check_invariant()
        except AssertionError as error:
            return f"KV invariant broken: {error}"
        return "ok"

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _problem(response: Any) -> str | None:
    """Why a response fails the run (None: it passes)."""
    if response.status_code >= 500:
        return f"status {response.status_code}"
    content_type = response.headers.get("Content-Type", "")
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)
        except ValueError:
            return f"{response.status_code} with a body that is not JSON"
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return f"{response.status_code} without an error message"
        return None
    if content_type.startswith("text/event-stream"):
        for line in response.content.split(b"\n"):
            if line.startswith(b"data: {") and b'"error"' in line:
                frame = json.loads(line[len(b"data: ") :])
                error = frame.get("error") if isinstance(frame, dict) else None
                if isinstance(error, dict) and error.get("type") not in {
                    "invalid_request_error",
                    "service_unavailable",
                }:
                    return f"in-band stream error {error}"
    return None


def fuzz(
    base_url: str, examples: int, seed: int, modes: tuple[str, ...] = ("positive", "negative")
) -> FuzzReport:
    import requests
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    document = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    report = FuzzReport()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            name = f"{operation.method.upper()} {operation.path} ({mode})"
            figures = report.operations.setdefault(name, OperationFigures())
            headers = (
                {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                if operation.path.startswith("/admin")
                else None
            )
            strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
            try:
                _sender(
                    strategy, examples, seed, base_url, session, headers, name, figures, report
                )()
            except Unsatisfiable:  # nothing to make invalid (no body, no parameters)
                del report.operations[name]
    return report


def _sender(
    strategy: Any,
    examples: int,
    seed: int,
    base_url: str,
    session: Any,
    headers: dict[str, str] | None,
    name: str,
    figures: OperationFigures,
    report: FuzzReport,
) -> Any:
    """A hypothesis test that sends ``examples`` generated cases of one operation and mode."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def send(case: Any) -> None:
        started = time.perf_counter()
        response = case.call(base_url=base_url, session=session, headers=headers, timeout=120)
        figures.seconds += time.perf_counter() - started
        figures.requests += 1
        figures.statuses[response.status_code] += 1
        problem = _problem(response)
        if problem is None and response.status_code >= 400:
            error = response.json()["error"]
            figures.refusals[
                f"{response.status_code} {error.get('param') or error.get('code')}"
            ] += 1
        if response.status_code == 200 and b'"finish_reason":"abort"' in response.content:
            report.aborted.append({"operation": name, "body": repr(case.body)[:1000]})
        if problem is not None:
            report.failures.append(
                {
                    "operation": name,
                    "problem": problem,
                    "body": repr(case.body)[:500],
                    "query": repr(case.query)[:200],
                    "response": response.text[:500],
                }
            )

    return send


def serves_normally(base_url: str) -> bool:
    import requests

    response = requests.post(
        f"{base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        timeout=60,
    )
    return response.status_code == 200 and bool(response.json()["choices"])


def run(config: Any, examples: int, seed: int) -> FuzzReport:
    server = BackgroundServer(config)
    base_url = server.start()
    try:
        report = fuzz(base_url, examples, seed)
        report.serving_after = serves_normally(base_url)
        report.leak_check = server.call(server.leak_check())
    finally:
        server.stop()
    return report


def print_table(report: FuzzReport, seconds: float) -> None:
    print(f"{'operation':<52} {'requests':>8}  statuses")
    for name, op in report.operations.items():
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(op.statuses.items()))
        print(f"{name:<52} {op.requests:>8}  {statuses}")
    statuses: Counter[int] = Counter()
    for op in report.operations.values():
        statuses.update(op.statuses)
    print(
        f"\n{report.requests} requests in {seconds:.0f} s; >= 500: "
        f"{sum(v for k, v in statuses.items() if k >= 500)}; failures: {len(report.failures)}; "
        f"serving after: {report.serving_after}; leak check: {report.leak_check}"
    )
    for failure in report.failures[:20]:
        print(json.dumps(failure))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="a model path or name; tiny: a random llama"
    )
    parser.add_argument("--examples", type=int, default=200, help="per operation and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--json", type=Path, default=Path("fuzz_api.json"))
    args = parser.parse_args()

    from asyncengine.config import EngineConfig

    with tempfile.TemporaryDirectory() as scratch:
        model = str(tiny_model(Path(scratch))) if args.model == "tiny" else args.model
        config = EngineConfig(
            model=model,
            dtype="float32",
            device="cpu",
            kv_cache_tokens=16384,
            max_model_len=args.max_model_len,
            log_interval=0.0,
        )
        started = time.perf_counter()
        report = run(config, args.examples, args.seed)
        seconds = time.perf_counter() - started
    print_table(report, seconds)
    figures = {**report.as_json(), "seconds": round(seconds, 1), "examples": args.examples}
    args.json.write_text(json.dumps(figures, indent=2))
    print(f"wrote {args.json}")
    ok = not report.failures and report.serving_after and report.leak_check == "ok"
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
