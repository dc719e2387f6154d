"""What the terminal shows: `generate` prints the text and its one-line report without the
engine's INFO lines unless -v; `serve` on a taken port says so in one line, before loading
anything (or starting Ray for replicas)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.server_support import MAX_MODEL_LEN, REPO_ROOT, tiny_model_dir


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "asyncengine.cli", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("replicas", [(), ("--replicas", "2")], ids=["one-engine", "replicas"])
def test_serve_on_a_taken_port_says_so_in_one_line(replicas: tuple[str, ...]) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that does not exist: the port is checked first, so it is never looked for
        result = cli(
            "serve", "--model", "/no/such/model", "--port", str(port), *replicas, timeout=120
        )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"asyncengine: error: port {port} is in use; pass --port"]


def test_serve_with_a_template_that_does_not_compile_stops_before_serving(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = tmp_path_factory.mktemp("tiny_broken_template")
    shutil.copytree(tiny_model_dir(tmp_path_factory), model, dirs_exist_ok=True)
    template = model / "chat_template.jinja"
    template.write_text("{% if add_generation_prompt %}<|im_start|>assistant\n")
    result = cli(
        "serve", "--model", str(model), "--dtype", "float32", "--device", "cpu",
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "2048", "--port", "0",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    (error,) = [line for line in result.stderr.splitlines() if "asyncengine: error:" in line]
    assert error.startswith(
        f"asyncengine: error: {template}: the chat template does not compile: line 1: "
        "Unexpected end of template."
    ), result.stderr[-2000:]
    assert error.endswith("The innermost block that needs to be closed is 'if'.")
    assert "serving" not in result.stderr


@pytest.mark.slow
def test_generate_shows_only_the_text_unless_verbose(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = str(tiny_model_dir(tmp_path_factory))
    common = (
        "generate", "Once upon a time", "--model", model, "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "2048",
        "--max-new-tokens", "40", "--temperature", "0", "--log-interval", "0.001",
    )  # fmt: skip
    quiet = cli(*common)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.strip()
    # stderr holds only the final report: no INFO lines (loading, engine ready, summaries)
    assert [line for line in quiet.stderr.splitlines() if line.strip()] == [
        line for line in quiet.stderr.splitlines() if line.startswith("[length]")
    ], quiet.stderr[-2000:]
    verbose = cli(*common, "-v")
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    assert verbose.stdout == quiet.stdout  # greedy: the same text
    assert "INFO asyncengine.api.engine: engine ready" in verbose.stderr
