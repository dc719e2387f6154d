"""scripts/load_test.py against a real server: many concurrent streaming clients, no failure,
no leaked KV page."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.server_support import (
    assert_no_leak,
    engine_config,
    engine_idle,
    start_server,
    tiny_model_dir,
    wait_until,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncengine_load_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.asyncio
async def test_64_concurrent_streaming_clients(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    load_test = load_script()
    server = await start_server(engine_config(tiny_model_dir(tmp_path_factory)))
    try:
        config = load_test.LoadConfig(
            url=server.base_url,
            clients=64,
            requests=96,
            max_tokens=4,
            duration_limit=90,
            request_timeout=90,
        )
        report = await load_test.run_load(config)
        assert report.failed == 0, report.errors
        assert report.completed == 96 and report.not_sent == 0
        assert report.ttft["count"] == 96 and report.e2e["p99"] >= report.e2e["p50"] > 0
        assert report.output_tokens_per_second > 0
        json.loads(report.to_json())  # valid JSON, no NaN
        chat = load_test.LoadConfig(
            url=server.base_url, clients=8, requests=8, max_tokens=3, endpoint="chat"
        )
        chat_report = await load_test.run_load(chat)
        assert chat_report.failed == 0 and chat_report.completed == 8, chat_report.errors
        assert await wait_until(lambda: engine_idle(server.engine))
        assert_no_leak(server.engine)
        successes = server.metrics.counter_value(
            "asyncengine_requests_total", {"endpoint": "completions", "outcome": "success"}
        )
        assert successes == 96
    finally:
        await server.stop()


def test_cli_writes_json(tmp_path: Path) -> None:
    """The script's CLI against a URL where nothing listens: every request fails, exit code 1."""
    load_test = load_script()
    out = tmp_path / "report.json"
    code = load_test.main(
        [
            "--url",
            "http://127.0.0.1:9",
            "--clients",
            "2",
            "--requests",
            "3",
            "--request-timeout",
            "5",
            "--json-out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 1
    assert report["completed"] == 0 and report["failed"] == 3
    assert report["ttft"]["p50"] is None
