"""The grammar compile processes, started by path (``python .../compile_worker.py``): a template
that imports xgrammar and nothing of the package, and forks one worker per pool thread.

Importing xgrammar takes seconds (it imports torch and transformers) and some 200 MB of private
memory; a fork of a process that did it takes milliseconds and shares those pages. The engine
cannot be that process (its threads and torch make a fork unsafe), so this one, started fresh,
does nothing but import, read the tokenizer and fork: it never compiles, and it forks with a
single thread (its libraries' thread pools kept at one thread, started lazily), so each worker
starts from the same clean state and nothing a compile does reaches the template or another
worker. A worker is a plain process of its own: a compile past its time limit is killed with it.

The template's stdin is a Unix socket to the pool (structured/compile_pool.py). The pool writes
the tokenizer's serialized ``TokenizerInfo`` as a frame; the template answers "ready". Then each
fork request is one byte carrying a socket (SCM_RIGHTS): the template forks a worker that serves
on it and answers with the worker's pid as text, carrying a pidfd of it, through which the pool
kills and watches the worker although it is not its child (no pid reuse race). The template
reaps its children (SIGCHLD ignored) and exits when the pool closes its socket.

A worker reads one frame per compile: JSON ``{"kind": ..., "spec": ..., "max_step_seconds":
...}``, and answers a frame per compile: the serialized ``CompiledGrammar``, or an error frame
(its header's ``"slow": true`` when the grammar's first mask took longer than
``max_step_seconds``). A frame is a line of JSON header ``{"ok": bool, "bytes": n}`` followed by
``n`` bytes. It serves until EOF (the pool closed its socket, or is gone), at a lower priority
than the engine. While it compiles (in xgrammar's code, which a Python handler cannot
interrupt), the socket is armed to send it SIGIO, whose default action ends the process, when
the pool's end closes: a compile never outlives an engine process that died.

Each compiled grammar's first mask is made here too: a grammar can compile in milliseconds and
then take seconds for that mask (nested repetitions), which the engine would otherwise pay on
its first step; here it counts against the compile's time limit, and its answer (too slow, or
no token can begin any output) is the compile's.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, BinaryIO

# json_object's longest run of whitespace: room for a newline and the indent of 3-4 levels
JSON_OBJECT_WHITESPACE = 16
COMPILE_NICENESS = 10  # scripts/grammar_flood.py measures what a flood of compiles costs others
# numpy's BLAS and torch's OpenMP size their thread pools from these as they load: one thread,
# so that the template forks single-threaded (a thread started at import would be left behind
# by the fork, its locks held for ever in the worker); a worker's one-row masks need no more
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FORK_REQUEST = b"f"  # the byte that carries a worker's socket to the template


def write_frame(out: BinaryIO, ok: bool, payload: bytes, slow: bool = False) -> None:
    header: dict[str, Any] = {"ok": ok, "bytes": len(payload)}
    if slow:
        header["slow"] = True
    out.write(json.dumps(header).encode() + b"\n" + payload)
    out.flush()


def read_frame(stream: BinaryIO | socket.SocketIO) -> tuple[bool, bytes] | None:
    """The next frame from a blocking stream; None at EOF."""
    header = stream.readline()
    if not header:
        return None
    fields = json.loads(header)
    payload = b""
    while len(payload) < fields["bytes"]:  # an unbuffered socket reads what has arrived
        chunk = stream.read(fields["bytes"] - len(payload))
        if not chunk:
            return None
        payload += chunk
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


def end_on_hangup(connection: socket.socket, armed: bool) -> None:
    """Armed: the kernel sends this process SIGIO (default action: it ends) when anything
    arrives on ``connection``, which during a compile is only the pool's end closing (the pool
    sends nothing until it has the answer); one that closed before it was armed ends it here.
    Disarmed before the answer is written: a full socket's freed space would signal too."""
    fd = connection.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not armed:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_ASYNC)
        return
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
    poll = select.poll()
    poll.register(fd, select.POLLIN | select.POLLHUP)
    if poll.poll(0):
        os._exit(0)


def serve(xgrammar: Any, compiler: Any, connection: socket.socket) -> None:
    """A worker: a frame back for each job read from ``connection``, until EOF."""
    jobs, answers = connection.makefile("rb"), connection.makefile("wb")
    while (frame := read_frame(jobs)) is not None:
        job = json.loads(frame[1])
        end_on_hangup(connection, True)
        try:
            compiled = compile_spec(compiler, job["kind"], job["spec"])
            problem = first_step_problem(xgrammar, compiled, job["max_step_seconds"])
        except (RuntimeError, ValueError, TypeError) as error:  # the spec's fault: a 400
            end_on_hangup(connection, False)
            write_frame(answers, False, str(error).encode())
            continue
        end_on_hangup(connection, False)
        if problem is not None:
            message, slow = problem
            write_frame(answers, False, message.encode(), slow)
            continue
        write_frame(answers, True, compiled.serialize_json().encode())


def fork_worker(control: socket.socket, xgrammar: Any, compiler: Any, connection_fd: int) -> int:
    """A worker serving on ``connection_fd``, forked from here; its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGIO, signal.SIG_DFL)  # end_on_hangup's signal ends it
            control.close()
            serve(xgrammar, compiler, socket.socket(fileno=connection_fd))
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)  # never the template's code past the fork
    os.close(connection_fd)  # the worker's alone: its EOF is the pool's
    return pid


def main() -> None:
    with contextlib.suppress(AttributeError, OSError):
        os.nice(COMPILE_NICENESS)  # the workers inherit it
    os.environ.update(SINGLE_THREADED)
    control = socket.socket(fileno=sys.stdin.fileno())
    sys.stdout = sys.stderr  # a library's print, Python's or native, goes to the log
    os.dup2(sys.stderr.fileno(), 1)
    import xgrammar  # seconds (it imports torch): while the pool reads the tokenizer

    first = read_frame(control.makefile("rb", buffering=0))  # nothing read past the frame
    if first is None:
        return
    info = xgrammar.TokenizerInfo.deserialize_json(first[1].decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # each worker's own copy
    write_frame(control.makefile("wb"), True, b"ready")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    gc.freeze()  # the workers' collections leave the import's objects, and their pages, shared
    while True:
        request, fds, _, _ = socket.recv_fds(control, 1, 1)
        if request != FORK_REQUEST or len(fds) != 1:  # EOF: the pool closed
            return
        pid = fork_worker(control, xgrammar, compiler, fds[0])
        pidfd = os.pidfd_open(pid)  # its child, not yet reaped: the pid is still its
        try:
            socket.send_fds(control, [str(pid).encode()], [pidfd])
        finally:
            os.close(pidfd)


if __name__ == "__main__":
    main()
