"""Fuzz every endpoint of a live server with bodies generated from its own /openapi.json.

    .venv/bin/python scripts/fuzz_api.py --examples 200            # the tiny random model
    .venv/bin/python scripts/fuzz_api.py --model smollm2-135m --examples 50
    .venv/bin/python scripts/fuzz_api.py --seconds 300 --seed 7    # the long run, reproducible
    .venv/bin/python scripts/fuzz_api.py --seconds 120 --path /v1/completions

``--seconds`` runs rounds over every operation (round ``r`` generates from seed ``seed + r``,
``--examples`` per operation and mode, 20 by default) until the time is spent; the same seed generates the
same bodies. Every request answered >= 500, and every request during which the server logged
an ERROR line (a traceback, a broken grammar), is written with its body, the seed and the round
to ``--findings`` (JSON lines) and fails the run; ERROR lines logged while no request was in
flight fail it too.

A server (engine + app, admin routes on) runs on 127.0.0.1 in a background thread; schemathesis
turns the document into valid ("positive") and invalid ("negative") requests for each
operation and sends them over loopback. A request fails the run when it is answered >= 500,
when a 4xx body is not the JSON error ``{"error": {"message": ...}}`` (Anthropic's Messages
routes put ``"type": "error"`` beside it), or when a stream carries a server error in-band. After the fuzzing the server must still answer a plain chat request,
go idle, and hold no KV page outside the prefix cache (the pool invariant checked). Prints a
table per operation and writes the figures as JSON (``--json``).

Valid bodies generated from a schema mostly break a rule the schema cannot say (content null
for a user turn, ...), so a third set of requests is built to be valid: tool-calling chats with
random function names and argument schemas, every tool_choice, earlier calls and results,
streamed or not. Each must be answered 200, and a call that finished must name a listed
function with arguments valid under its schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADMIN_TOKEN = "fuzz-admin"
MAX_NEW_TOKENS = 160  # the server's max_new_tokens_limit: a fuzzed request generates briefly
EXAMPLES = 200  # generated cases per operation and mode, in one round
ROUND_EXAMPLES = 20  # the same, per round of a --seconds run
REQUEST_TIMEOUT = 300.0  # seconds; a request not answered by then fails the run
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


class ErrorLines(logging.Handler):
    """Every ERROR (and worse) record the server logs, in order (the server shares this
    process: its loop runs in a thread)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            line += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        self.lines.append(line[:2000])


@dataclass(slots=True)
class FuzzReport:
    operations: dict[str, OperationFigures] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[dict[str, Any]] = field(default_factory=list)  # 200s that ended "abort"
    serving_after: bool = False
    leak_check: str = "not run"
    error_lines: int = 0  # server ERROR lines seen, with a request or without
    rounds: int = 0
    deadline: float | None = None  # time.monotonic() past which no request is sent
    log: ErrorLines | None = None

    @property
    def requests(self) -> int:
        return sum(op.requests for op in self.operations.values())

    @property
    def server_errors(self) -> int:
        return sum(v for op in self.operations.values() for k, v in op.statuses.items() if k >= 500)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "responses_5xx": self.server_errors,
            "server_error_lines": self.error_lines,
            "rounds": self.rounds,
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
        from asyncengine.api.engine import AsyncEngine
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
        if (
            stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"]
            != stats["pages_total"]
        ):
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
                if _server_error_in_band(frame):
                    return f"in-band stream error {frame}"
    return None


def _server_error_in_band(frame: Any) -> bool:
    """Whether a streamed frame reports a server error: OpenAI's and Anthropic's
    ``{"error": {"type"}}`` (Anthropic's under ``"type": "error"``), the Responses API's
    ``{"type": "error", "code"}``."""
    if not isinstance(frame, dict):
        return False
    error = frame.get("error")
    if isinstance(error, dict):
        return error.get("type") not in {
            "invalid_request_error",
            "service_unavailable",
            "overloaded_error",
        }
    return frame.get("type") == "error" and frame.get("code") in {"request_failed", "server_error"}


def fuzz(
    base_url: str,
    examples: int,
    seed: int,
    modes: tuple[str, ...] = ("positive", "negative"),
    report: FuzzReport | None = None,
    paths: tuple[str, ...] = (),
) -> FuzzReport:
    """One round: ``examples`` generated cases per operation (those whose path starts with one
    of ``paths``, all when empty) and mode, from ``seed``."""
    import requests
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    from asyncengine.server.admin import ADMIN_PATHS, ADMIN_PREFIX
    from asyncengine.server.sglang_worker import FLUSH_PATH

    # the routes the admin token opens (the server has one): fuzzed past their 401
    admin_only = ADMIN_PATHS | {FLUSH_PATH}
    document = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    report = report if report is not None else FuzzReport()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths and not operation.path.startswith(paths):
            continue
        for mode in modes:
            name = f"{operation.method.upper()} {operation.path} ({mode})"
            figures = report.operations.setdefault(name, OperationFigures())
            headers = (
                {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                if operation.path.startswith(ADMIN_PREFIX) or operation.path in admin_only
                else None
            )
            strategy = operation.as_strategy(generation_mode=GenerationMode(mode))
            try:
                _sender(
                    strategy, examples, seed, base_url, session, headers, name, figures, report
                )()
            except Unsatisfiable:  # nothing to make invalid (no body, no parameters)
                if not figures.requests:
                    del report.operations[name]
            except TimeUp:
                return report
    return report


def fuzz_for(
    base_url: str,
    seconds: float,
    examples: int,
    seed: int,
    paths: tuple[str, ...] = (),
    report: FuzzReport | None = None,
) -> FuzzReport:
    """Rounds of ``fuzz`` (round r from seed ``seed + r``) until ``seconds`` have passed."""
    report = report if report is not None else FuzzReport()
    report.deadline = time.monotonic() + seconds
    while time.monotonic() < report.deadline:
        fuzz(base_url, examples, seed + report.rounds, report=report, paths=paths)
        report.rounds += 1
    return report


class TimeUp(Exception):
    """The run's time is spent (raised out of a hypothesis test to end it)."""


def _error_lines_since(report: FuzzReport, seen: int) -> list[str]:
    return [] if report.log is None else report.log.lines[seen:]


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
    import requests
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(case=strategy)
    def send(case: Any) -> None:
        if report.deadline is not None and time.monotonic() > report.deadline:
            raise TimeUp
        started = time.perf_counter()
        logged_before = len(report.log.lines) if report.log is not None else 0
        try:
            response = case.call(
                base_url=base_url, session=session, headers=headers, timeout=REQUEST_TIMEOUT
            )
        except requests.Timeout:
            report.failures.append(
                {"operation": name, "problem": "no answer in time", "body": repr(case.body)[:500]}
            )
            return
        figures.seconds += time.perf_counter() - started
        figures.requests += 1
        figures.statuses[response.status_code] += 1
        problem = _problem(response)
        if problem is None and response.status_code >= 400:
            error = response.json()["error"]
            reason = error.get("param") or error.get("code") or error.get("type")
            figures.refusals[f"{response.status_code} {reason}"] += 1
        if response.status_code == 200 and b'"finish_reason":"abort"' in response.content:
            report.aborted.append({"operation": name, "body": repr(case.body)[:1000]})
        errors = _error_lines_since(report, logged_before)
        if errors:
            report.error_lines += len(errors)
            problem = "; ".join(filter(None, [problem, f"{len(errors)} server ERROR line(s)"]))
        if problem is not None:
            report.failures.append(
                {
                    "operation": name,
                    "seed": seed,
                    "round": report.rounds,
                    "problem": problem,
                    "status": response.status_code,
                    "body": _json_or_repr(case.body)[:4000],
                    "query": repr(case.query)[:200],
                    "response": response.text[:500],
                    "server_errors": errors[:5],
                }
            )

    return send


def _json_or_repr(body: Any) -> str:
    """The body as it went on the wire where it is JSON (paste it into curl), else its repr."""
    try:
        return json.dumps(body)
    except (TypeError, ValueError):
        return repr(body)


def _tool_chat_bodies() -> Any:
    """Valid chat requests with tools: random function names and argument schemas, every
    tool_choice, earlier calls and results in the conversation, streamed or not."""
    from hypothesis import strategies as st

    names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
    leaf = st.one_of(
        st.just({"type": "string", "maxLength": 8}),
        st.just({"type": "integer", "minimum": -5, "maximum": 500}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.lists(
            st.text("abc xyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True
        ).map(lambda values: {"type": "string", "enum": values}),
    )
    value = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.builds(lambda items: {"type": "array", "items": items, "maxItems": 3}, inner),
            st.dictionaries(names, inner, min_size=1, max_size=3).map(
                lambda props: {"type": "object", "properties": props, "required": sorted(props)}
            ),
        ),
        max_leaves=4,
    )
    parameters = st.one_of(
        st.none(),
        st.dictionaries(names, value, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props) or [""]), unique=True).map(
                lambda required: {
                    "type": "object",
                    "properties": props,
                    "required": [r for r in required if r in props],
                }
            )
        ),
    )

    def request(draw: Any) -> dict[str, Any]:
        tool_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
        tools = [
            {"type": "function", "function": {"name": n, "parameters": draw(parameters)}}
            for n in tool_names
        ]
        for tool in tools:
            if tool["function"]["parameters"] is None:
                del tool["function"]["parameters"]
        choice = draw(
            st.sampled_from(["absent", "none", "auto", "required", *[f"={n}" for n in tool_names]])
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": draw(st.text(max_size=40))}]
        if draw(st.booleans()):
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": tool_names[0], "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": draw(st.text(max_size=20))},
            ]
        body: dict[str, Any] = {
            "messages": messages,
            "tools": tools,
            "max_tokens": draw(st.integers(1, 160)),
            "temperature": draw(st.sampled_from([0.0, 0.7, 1.5])),
            "seed": draw(st.integers(0, 1000)),
            "parallel_tool_calls": draw(st.booleans()),
            "stream": draw(st.booleans()),
        }
        if choice.startswith("="):
            body["tool_choice"] = {"type": "function", "function": {"name": choice[1:]}}
        elif choice != "absent":
            body["tool_choice"] = choice
        return body

    return st.composite(request)()


def _tool_chat_problem(body: dict[str, Any], response: Any) -> str | None:
    """A valid request must be answered 200, and a forced call that finished must validate."""
    import jsonschema

    if response.status_code == 400 and b"context_length_exceeded" in response.content:
        return None  # valid, but the tools' prompt does not fit the context
    if response.status_code != 200:
        return f"status {response.status_code}: {response.text[:300]}"
    if body["stream"]:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for line in response.content.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            frame = json.loads(line[len(b"data: ") :])
            if "error" in frame:
                return f"in-band error {frame['error']}"
            for choice in frame["choices"]:
                finish = choice["finish_reason"] or finish
                for piece in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                    call["name"] += piece["function"].get("name") or ""
                    call["arguments"] += piece["function"].get("arguments") or ""
        found = list(calls.values())
    else:
        choice = response.json()["choices"][0]
        finish = choice["finish_reason"]
        found = [c["function"] for c in choice["message"].get("tool_calls") or []]
    forced = body.get("tool_choice") not in (None, "none", "auto")
    if forced and finish == "stop":
        return "a forced tool choice ended without a call"
    if finish != "tool_calls":
        return None
    if not found:
        return "finish_reason tool_calls without calls"
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in body["tools"]}
    for call in found:
        if call["name"] not in schemas:
            return f"a call of an unknown function {call['name']!r}"
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            return f"arguments that are not JSON: {call['arguments']!r}"
        schema = schemas[call["name"]]
        if schema is not None:
            try:
                jsonschema.validate(arguments, schema)
            except jsonschema.ValidationError as error:
                return f"arguments {call['arguments']} break the schema: {error.message}"
    return None


def fuzz_tool_chats(base_url: str, examples: int, seed: int, report: FuzzReport) -> None:
    """Valid tool-calling chats (``_tool_chat_bodies``) sent as the operation
    "POST /v1/chat/completions (tools)"."""
    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    name = "POST /v1/chat/completions (tools)"
    figures = report.operations.setdefault(name, OperationFigures())
    session = requests.Session()

    @hypothesis_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body=_tool_chat_bodies())
    def send(body: dict[str, Any]) -> None:
        started = time.perf_counter()
        logged_before = len(report.log.lines) if report.log is not None else 0
        try:
            response = session.post(
                f"{base_url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT
            )
        except requests.Timeout:
            report.failures.append({"operation": name, "problem": "no answer in time"})
            return
        figures.seconds += time.perf_counter() - started
        figures.requests += 1
        figures.statuses[response.status_code] += 1
        if response.status_code == 200 and not body["stream"]:
            figures.refusals[f"200 {response.json()['choices'][0]['finish_reason']}"] += 1
        elif response.status_code >= 400:
            figures.refusals[f"{response.status_code} {response.json()['error'].get('code')}"] += 1
        problem = _tool_chat_problem(body, response)
        errors = _error_lines_since(report, logged_before)
        if errors:
            report.error_lines += len(errors)
            problem = "; ".join(filter(None, [problem, f"{len(errors)} server ERROR line(s)"]))
        if problem is not None:
            report.failures.append(
                {
                    "operation": name,
                    "seed": seed,
                    "problem": problem,
                    "body": json.dumps(body)[:1500],
                    "server_errors": errors[:5],
                }
            )

    send()


def serves_normally(base_url: str) -> bool:
    import requests

    response = requests.post(
        f"{base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        timeout=60,
    )
    return response.status_code == 200 and bool(response.json()["choices"])


def run(
    config: Any,
    examples: int,
    seed: int,
    tool_examples: int,
    seconds: float | None = None,
    paths: tuple[str, ...] = (),
) -> FuzzReport:
    """Serve, fuzz (one round, or rounds for ``seconds``), then check the server still serves
    and leaks nothing; the server's ERROR lines are collected throughout."""
    report = FuzzReport(log=ErrorLines())
    logging.getLogger().addHandler(report.log)
    server = BackgroundServer(config)
    base_url = server.start()
    try:
        if seconds is None:
            fuzz(base_url, examples, seed, report=report, paths=paths)
            report.rounds = 1
        else:
            fuzz_for(base_url, seconds, examples, seed, paths=paths, report=report)
        report.deadline = None
        if not paths or any("/v1/chat/completions".startswith(p) for p in paths):
            fuzz_tool_chats(base_url, tool_examples, seed, report)
        report.serving_after = serves_normally(base_url)
        report.leak_check = server.call(server.leak_check())
    finally:
        server.stop()
        logging.getLogger().removeHandler(report.log)
    stray = len(report.log.lines) - report.error_lines
    if stray > 0:
        report.failures.append(
            {"operation": "none in flight", "problem": f"{stray} server ERROR line(s)",
             "server_errors": report.log.lines[-5:]}
        )  # fmt: skip
        report.error_lines += stray
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
        f"\n{report.requests} requests in {seconds:.0f} s ({report.rounds} round(s)); >= 500: "
        f"{sum(v for k, v in statuses.items() if k >= 500)}; server ERROR lines: "
        f"{report.error_lines}; failures: {len(report.failures)}; "
        f"serving after: {report.serving_after}; leak check: {report.leak_check}"
    )
    for failure in report.failures[:20]:
        print(json.dumps(failure))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="a model path or name; tiny: a random llama"
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=None,
        help=f"per operation and mode (default {EXAMPLES}; with --seconds, per round: "
        f"{ROUND_EXAMPLES}, so that each round reaches every operation)",
    )
    parser.add_argument("--tool-examples", type=int, default=100, help="valid tool chats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seconds", type=float, default=None, help="rounds until this much time is spent"
    )
    parser.add_argument(
        "--path", action="append", default=[], help="only operations under this path (repeatable)"
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=Path("fuzz_api.json"))
    parser.add_argument(
        "--findings",
        type=Path,
        default=Path("fuzz_findings.jsonl"),
        help="each failing request (5xx, server ERROR line, bad error body) as a JSON line",
    )
    args = parser.parse_args()
    if args.examples is None:
        args.examples = EXAMPLES if args.seconds is None else ROUND_EXAMPLES
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from asyncengine.common.config import EngineConfig

    with tempfile.TemporaryDirectory() as scratch:
        model = str(tiny_model(Path(scratch))) if args.model == "tiny" else args.model
        config = EngineConfig(
            model=model,
            dtype="float32",
            device="cpu",
            kv_cache_tokens=16384,
            max_model_len=args.max_model_len,
            max_new_tokens_limit=MAX_NEW_TOKENS,
            log_interval=0.0,
        )
        started = time.perf_counter()
        report = run(
            config, args.examples, args.seed, args.tool_examples, args.seconds, tuple(args.path)
        )
        seconds = time.perf_counter() - started
    print_table(report, seconds)
    figures = {
        **report.as_json(),
        "seconds": round(seconds, 1),
        "examples": args.examples,
        "tool_examples": args.tool_examples,
    }
    args.json.write_text(json.dumps(figures, indent=2))
    args.findings.write_text("".join(json.dumps(f) + "\n" for f in report.failures))
    print(f"wrote {args.json} and {args.findings} ({len(report.failures)} finding(s))")
    ok = not report.failures and report.serving_after and report.leak_check == "ok"
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
