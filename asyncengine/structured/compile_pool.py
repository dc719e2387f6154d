"""Worker processes that compile grammars, each killed when a compile passes its time limit.

    pool = CompilePool(workers=2, setup=tokenizer_info_json)  # threads, then their processes
    future = pool.submit(run)        # run() on a pool thread; cancel() before it starts
    pool.compile("regex", "[0-9]+", timeout=10.0, max_step_seconds=0.25)
                                     # within run(): (ok, payload) from the thread's own
                                     # process; CompileTimeout once it was killed

A thread cannot be stopped, and xgrammar can compile a pathological regex for minutes: each
pool thread owns a worker process and hands it one compile at a time. Past the limit the
process is killed and a fresh one started in its place, so no client holds a worker longer
than the limit. The engine has threads and torch, so nothing is forked from it: the pool starts
one fresh interpreter, the template (structured/compile_worker.py), which imports xgrammar
once (seconds) and forks each worker (milliseconds, its memory shared until written). The pool
holds a pidfd of each worker: it kills and waits for a process that is the template's child,
with no race against its pid's reuse (Linux 5.3 or later).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from asyncengine.structured.compile_worker import FORK_REQUEST

WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")  # by path: no package imports
REAP_WAIT_SECONDS = 1.0  # a killed worker's exit to its reaping by the template: microseconds


class CompileTimeout(Exception):
    """The compile ran past its limit; its worker process was killed."""


class WorkerGone(Exception):
    """The worker process exited while it compiled (it crashed, or the pool closed)."""


class FirstStepTooSlow(Exception):
    """The grammar compiled, but its first mask took longer than its limit (the message says
    how long)."""


class FrameChannel:
    """Frames (structured/compile_worker.py) over our end of a socket pair, read with an
    optional deadline."""

    def __init__(self, end: socket.socket) -> None:
        self.end = end
        self._buffer = bytearray()
        self.broken = False  # the other end closed, or its process gone

    def send(self, ok: bool, payload: bytes) -> None:
        try:
            self.end.sendall(
                json.dumps({"ok": ok, "bytes": len(payload)}).encode() + b"\n" + payload
            )
        except OSError:  # the process gone, or this end closed by kill()
            self.broken = True
            raise WorkerGone from None

    def receive(self, deadline: float | None) -> tuple[dict[str, Any], bytes]:
        while (end := self._buffer.find(b"\n")) < 0:
            self._fill(deadline)
        header = json.loads(self._buffer[:end])
        size = int(header["bytes"])
        while len(self._buffer) < end + 1 + size:
            self._fill(deadline)
        payload = bytes(self._buffer[end + 1 : end + 1 + size])
        del self._buffer[: end + 1 + size]
        return header, payload

    def close(self) -> None:
        self.broken = True
        self.end.close()

    def _fill(self, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CompileTimeout
        try:
            if not _readable(self.end.fileno(), left):
                raise CompileTimeout
            chunk = self.end.recv(1 << 20)
        except (OSError, ValueError):  # closed by kill()
            chunk = b""
        if not chunk:
            self.broken = True
            raise WorkerGone
        self._buffer += chunk


class WorkerProcess:
    """One compile worker process, forked by the template; used by one thread at a time, and
    killed from any."""

    def __init__(self, end: socket.socket, pid: int, pidfd: int) -> None:
        self._channel = FrameChannel(end)
        self.pid = pid
        self._pidfd = pidfd
        self._lock = threading.Lock()  # the pidfd is closed by one thread, used by any
        self._closed = False

    def alive(self) -> bool:
        with self._lock:
            return not self._closed and not self._channel.broken and not self._exited(0)

    def compile(
        self, kind: str, spec: str, timeout: float, max_step_seconds: float
    ) -> tuple[bool, bytes]:
        """(True, the serialized CompiledGrammar) or (False, the problem: xgrammar's error
        message, or no output possible); CompileTimeout (the process killed) past ``timeout``
        seconds; FirstStepTooSlow when the grammar's first mask took over
        ``max_step_seconds`` of CPU time (structured/compile_worker.py)."""
        job = {"kind": kind, "spec": spec, "max_step_seconds": max_step_seconds}
        self._channel.send(True, json.dumps(job).encode())
        try:
            header, payload = self._channel.receive(time.monotonic() + timeout)
        except CompileTimeout:
            self.kill()
            raise
        if header.get("slow"):
            raise FirstStepTooSlow(payload.decode(errors="replace"))
        return bool(header["ok"]), payload

    def signal_kill(self) -> None:
        """SIGKILL, from any thread: its owner then reads EOF and calls ``kill()``."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def kill(self) -> None:
        """Kill it, wait until it is gone (reaped by the template) and close our ends (by the
        thread that uses it)."""
        self.signal_kill()
        with self._lock:
            if self._closed:
                return
            self._exited(None)
            deadline = time.monotonic() + REAP_WAIT_SECONDS
            while time.monotonic() < deadline:  # exited, then reaped: its pid no longer names it
                try:
                    signal.pidfd_send_signal(self._pidfd, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.001)
            self._closed = True
            self._channel.close()
            os.close(self._pidfd)

    def _exited(self, timeout: float | None) -> bool:
        return _readable(self._pidfd, timeout)  # a pidfd reads once its process has ended


class WorkerTemplate:
    """The process that imports xgrammar and forks the workers (structured/compile_worker.py);
    its requests, from any pool thread, one at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT)], stdin=theirs.fileno()
            )
        finally:
            theirs.close()
        self._channel = FrameChannel(ours)
        self._lock = threading.Lock()
        self._ready = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return not self._channel.broken and self._proc.poll() is None

    def wait_ready(self, tokenizer_info: bytes) -> None:
        """Send the tokenizer (once) and wait until the template has imported xgrammar and read
        it: seconds, once."""
        with self._lock:
            if not self._ready:
                self._channel.send(True, tokenizer_info)
                self._channel.receive(None)
                self._ready = True

    def fork(self) -> WorkerProcess:
        """A fresh worker, ready for a compile: milliseconds. WorkerGone when the template is."""
        ours, theirs = socket.socketpair()
        message = b""
        fds: list[int] = []
        try:
            with self._lock:
                try:
                    socket.send_fds(self._channel.end, [FORK_REQUEST], [theirs.fileno()])
                    message, fds, _, _ = socket.recv_fds(self._channel.end, 32, 1)
                except (OSError, ValueError):  # gone, or closed by kill()
                    pass
        finally:
            theirs.close()
        if not message or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            ours.close()
            self._channel.broken = True
            raise WorkerGone
        return WorkerProcess(ours, int(message), fds[0])

    def signal_kill(self) -> None:
        """SIGKILL, from any thread (its workers live on until killed themselves)."""
        if self._proc.poll() is None:
            self._proc.kill()

    def kill(self) -> None:
        """Kill, reap and close."""
        self.signal_kill()
        self._proc.wait()
        with self._lock:  # no thread reads its socket any more
            self._channel.close()


def _readable(fd: int, timeout: float | None) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(timeout))


class CompilePool:
    """``workers`` threads, each with its own worker process, taking jobs first come first
    served. ``setup`` (called once per thread, before its process starts) returns the
    serialized ``TokenizerInfo`` the processes compile for."""

    def __init__(self, workers: int, setup: Callable[[], bytes]) -> None:
        self._setup = setup
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self._processes: list[WorkerProcess] = []
        self._template: WorkerTemplate | None = None
        self._template_lock = threading.Lock()  # one template started at a time
        self._closed = False
        self.killed = 0  # compiles past their limit (their processes killed)
        self._threads = [
            threading.Thread(target=self._serve, name=f"asyncengine-grammar-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def live_pids(self) -> list[int]:
        """The worker processes ready for a job (a killed one's replacement once it started)."""
        with self._lock:
            return [p.pid for p in self._processes if p.alive()]

    def template_pid(self) -> int | None:
        """The template's process, once started."""
        with self._lock:
            return None if self._template is None else self._template.pid

    def submit(self, run: Callable[[], Any]) -> Future[Any]:
        """``run()`` on a pool thread; its future's ``cancel()`` works until a thread takes it."""
        future: Future[Any] = Future()
        self._jobs.put((future, run))
        return future

    def compile(
        self, kind: str, spec: str, timeout: float, max_step_seconds: float
    ) -> tuple[bool, bytes]:
        """In ``run()``: compile on this thread's process (see WorkerProcess.compile)."""
        try:
            return self._local.process.compile(kind, spec, timeout, max_step_seconds)
        except CompileTimeout:
            with self._lock:
                self.killed += 1
            raise

    def close(self) -> None:
        """Kill the processes; queued jobs are cancelled, running ones fail with WorkerGone.
        Returns once every thread has ended and every process is reaped (a thread still reading
        the tokenizer takes seconds: call it off the event loop)."""
        with self._lock:
            self._closed = True
            processes = list(self._processes)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for process in processes:
            process.signal_kill()
        with self._lock:  # none started from here on
            template = self._template
        if template is not None:
            template.signal_kill()
        for thread in self._threads:
            thread.join()
        if template is not None:
            template.kill()

    def _serve(self) -> None:
        tokenizer_info: bytes | None = None
        try:  # the template starts now, ahead of the first job (seconds: xgrammar's import)
            self._started_template()  # its imports overlap the tokenizer's reading here
            tokenizer_info = self._setup()
            self._ensure_process(tokenizer_info)
        except Exception:  # WorkerGone once closed; anything else the first job reports
            pass
        # a thread takes a job only with its process ready: none waits while another is idle
        while (job := self._jobs.get()) is not None:
            future, run = job
            if not future.set_running_or_notify_cancel():
                continue  # no request wants it any more: it never runs
            try:
                if tokenizer_info is None:
                    tokenizer_info = self._setup()
                self._ensure_process(tokenizer_info)
                result = run()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)
            try:
                if tokenizer_info is not None:
                    self._ensure_process(tokenizer_info)  # a killed one is replaced at once
            except Exception:  # the next job tries again, and reports it
                if self._closed:
                    break
        process: WorkerProcess | None = getattr(self._local, "process", None)
        if process is not None:
            process.kill()

    def _ensure_process(self, tokenizer_info: bytes) -> None:
        current: WorkerProcess | None = getattr(self._local, "process", None)
        if current is not None and current.alive():
            return
        if current is not None:
            current.kill()  # reaped, its ends closed
            with self._lock:
                self._processes.remove(current)
            self._local.process = None
        self._local.process = self._spawn(tokenizer_info)

    def _spawn(self, tokenizer_info: bytes) -> WorkerProcess:
        """A worker forked by the template; a template found dead (killed, as by the kernel's
        OOM killer) is started afresh, once."""
        for attempt in range(2):
            template = self._started_template()
            try:
                template.wait_ready(tokenizer_info)
                process = template.fork()
                break
            except WorkerGone:
                if attempt == 1 or self._closed:
                    raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._processes.append(process)
        if closed:
            process.kill()
            raise WorkerGone
        return process

    def _started_template(self) -> WorkerTemplate:
        with self._template_lock:
            template = self._template
            if template is not None and template.alive():
                return template
            if self._closed:
                raise WorkerGone
            if template is not None:
                template.kill()
            template = WorkerTemplate()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._template = template
            if closed:
                template.kill()
                raise WorkerGone
            return template
