"""A grammar compile worker process, started by path (``python .../compile_worker.py``): it
imports xgrammar and nothing of the package.

The parent (structured/compile_pool.py) writes the tokenizer's serialized ``TokenizerInfo``,
then one frame per compile: JSON ``{"kind": ..., "spec": ..., "max_step_seconds": ...}``. The
worker answers "ready" once, then a frame per compile: the serialized ``CompiledGrammar``, or
an error frame (its header's ``"slow": true`` when the grammar's first mask took longer than
``max_step_seconds``). A frame is a line of JSON header ``{"ok": bool, "bytes": n}`` followed
by ``n`` bytes. A process, not a thread, so that a compile past its time limit can be killed;
it reads from stdin until EOF (its parent gone) and runs at a lower priority than the engine.

Each compiled grammar's first mask is made here too: a grammar can compile in milliseconds and
then take seconds for that mask (nested repetitions), which the engine would otherwise pay on
its first step; here it counts against the compile's time limit, and its answer (too slow, or
no token can begin any output) is the compile's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, BinaryIO

# json_object's longest run of whitespace: room for a newline and the indent of 3-4 levels
JSON_OBJECT_WHITESPACE = 16
COMPILE_NICENESS = 10  # scripts/grammar_flood.py measures what a flood of compiles costs others


def write_frame(out: BinaryIO, ok: bool, payload: bytes, slow: bool = False) -> None:
    header: dict[str, Any] = {"ok": ok, "bytes": len(payload)}
    if slow:
        header["slow"] = True
    out.write(json.dumps(header).encode() + b"\n" + payload)
    out.flush()


def read_frame(stream: BinaryIO) -> tuple[bool, bytes] | None:
    """The next frame from a blocking stream; None at EOF."""
    header = stream.readline()
    if not header:
        return None
    fields = json.loads(header)
    payload = stream.read(fields["bytes"])
    if len(payload) != fields["bytes"]:
        return None
    return bool(fields["ok"]), payload


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    if kind == "json_object":
        # an object, as OpenAI's JSON mode promises (xgrammar's built-in grammar takes any JSON
        # value), laid out freely but with bounded runs of whitespace: a weak model padded the
        # unbounded grammar's output with blanks to the length limit
        return compiler.compile_json_schema(
            '{"type": "object"}',
            any_whitespace=True,
            max_whitespace_cnt=JSON_OBJECT_WHITESPACE,
            strict_mode=False,
        )
    if kind == "json_schema":
        # compact JSON: a model cannot pad the output with endless whitespace
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "structural_tag":  # tool calls (structured/tool_grammar.py)
        return compiler.compile_structural_tag(spec)
    return compiler.compile_grammar(spec)


def first_step_problem(
    xgrammar: Any, compiled: Any, max_step_seconds: float
) -> tuple[str, bool] | None:
    """Why ``compiled`` cannot be served, judged by its first mask, and whether it is that the
    mask was too slow (this thread's CPU time, as the engine's matcher times its steps); the
    other reason: no token may begin any output (the regex "[^\\s\\S]": sampling from an
    all-forbidden row would pick an arbitrary token)."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    start = time.thread_time()
    matcher.fill_next_token_bitmask(bitmask, 0)
    seconds = time.thread_time() - start
    if seconds > max_step_seconds:
        return f"its first token's mask took {seconds:.2f} s", True
    if not matcher.is_terminated() and not bool(bitmask.any()):
        return "the constraint admits no output: no token can begin it", False
    return None


def main() -> None:
    with contextlib.suppress(AttributeError, OSError):
        os.nice(COMPILE_NICENESS)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a library's print must not corrupt the frames
    import xgrammar  # seconds (it imports torch): while the parent reads the tokenizer

    first = read_frame(stdin)
    if first is None:
        return

    info = xgrammar.TokenizerInfo.deserialize_json(first[1].decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    write_frame(stdout, True, b"ready")
    while (frame := read_frame(stdin)) is not None:
        job = json.loads(frame[1])
        try:
            compiled = compile_spec(compiler, job["kind"], job["spec"])
            problem = first_step_problem(xgrammar, compiled, job["max_step_seconds"])
        except (RuntimeError, ValueError, TypeError) as error:  # the spec's fault: a 400
            write_frame(stdout, False, str(error).encode())
            continue
        if problem is not None:
            message, slow = problem
            write_frame(stdout, False, message.encode(), slow)
            continue
        write_frame(stdout, True, compiled.serialize_json().encode())


if __name__ == "__main__":
    main()
