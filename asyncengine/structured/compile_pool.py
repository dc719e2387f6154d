"""Worker processes that compile grammars, each killed when a compile passes its time limit.

    pool = CompilePool(workers=2, setup=tokenizer_info_json)  # threads, then their processes
    future = pool.submit(run)        # run() on a pool thread; cancel() before it starts
    pool.compile("regex", "[0-9]+", timeout=10.0, max_step_seconds=0.25)
                                     # within run(): (ok, payload) from the thread's own
                                     # process; CompileTimeout once it was killed

A thread cannot be stopped, and xgrammar can compile a pathological regex for minutes: each
pool thread owns a worker process (structured/compile_worker.py, a fresh interpreter: the
engine has threads and torch, so nothing is forked) and hands it one compile at a time. Past
the limit the process is killed and a fresh one started in its place, so no client holds a
worker longer than the limit.
"""

from __future__ import annotations

import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")  # by path: no package imports


class CompileTimeout(Exception):
    """The compile ran past its limit; its worker process was killed."""


class WorkerGone(Exception):
    """The worker process exited while it compiled (it crashed, or the pool closed)."""


class FirstStepTooSlow(Exception):
    """The grammar compiled, but its first mask took longer than its limit (the message says
    how long)."""


class WorkerProcess:
    """One compile worker process; used by one thread at a time."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._buffer = bytearray()
        self._told = False  # the tokenizer sent
        self.ready = False
        self._broken = False  # its pipe closed: it may not have been reaped yet

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return not self._broken and self._proc.poll() is None

    def wait_ready(self, tokenizer_info: bytes) -> None:
        """Send the tokenizer (once) and wait until the worker has imported xgrammar and read
        it: seconds, once."""
        if not self._told:
            self._told = True
            self._send(True, tokenizer_info)
        if not self.ready:
            self._receive(None)
            self.ready = True

    def compile(
        self, kind: str, spec: str, timeout: float, max_step_seconds: float
    ) -> tuple[bool, bytes]:
        """(True, the serialized CompiledGrammar) or (False, the problem: xgrammar's error
        message, or no output possible); CompileTimeout (the process killed) past ``timeout``
        seconds; FirstStepTooSlow when the grammar's first mask took over
        ``max_step_seconds`` of CPU time (structured/compile_worker.py)."""
        job = {"kind": kind, "spec": spec, "max_step_seconds": max_step_seconds}
        self._send(True, json.dumps(job).encode())
        try:
            header, payload = self._receive(time.monotonic() + timeout)
        except CompileTimeout:
            self.kill()
            raise
        if header.get("slow"):
            raise FirstStepTooSlow(payload.decode(errors="replace"))
        return bool(header["ok"]), payload

    def signal_kill(self) -> None:
        """SIGKILL, from any thread: its owner then reads EOF and calls ``kill()``."""
        if self._proc.poll() is None:
            self._proc.kill()

    def kill(self) -> None:
        """Kill, reap and close (by the thread that uses it)."""
        self.signal_kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()

    def _send(self, ok: bool, payload: bytes) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"ok": ok, "bytes": len(payload)}).encode() + b"\n" + payload)
            stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: closed by kill()
            self._broken = True
            raise WorkerGone from None

    def _receive(self, deadline: float | None) -> tuple[dict[str, Any], bytes]:
        while (end := self._buffer.find(b"\n")) < 0:
            self._fill(deadline)
        header = json.loads(self._buffer[:end])
        size = int(header["bytes"])
        while len(self._buffer) < end + 1 + size:
            self._fill(deadline)
        payload = bytes(self._buffer[end + 1 : end + 1 + size])
        del self._buffer[: end + 1 + size]
        return header, payload

    def _fill(self, deadline: float | None) -> None:
        stdout = self._proc.stdout
        if stdout is None or stdout.closed:
            raise WorkerGone
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise CompileTimeout
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(left):
                raise CompileTimeout
        chunk = os.read(stdout.fileno(), 1 << 20)
        if not chunk:
            self._broken = True
            raise WorkerGone
        self._buffer += chunk


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
        self._closed = False
        self.killed = 0  # compiles past their limit (their processes killed)
        self._first_started = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._serve, args=(i == 0,), name=f"asyncengine-grammar-{i}", daemon=True
            )
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
            return [p.pid for p in self._processes if p.ready and p.alive()]

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
        Returns once every thread has ended and reaped its process (a thread still reading
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
        for thread in self._threads:
            thread.join()

    def _serve(self, first: bool) -> None:
        tokenizer_info: bytes | None = None
        if not first:  # the first request waits for one start-up, not several sharing the cores
            self._first_started.wait()
        try:  # the process starts now, ahead of the first job (seconds: xgrammar's import)
            self._spawn()  # its imports overlap the tokenizer's reading here
            tokenizer_info = self._setup()
            self._ensure_process(tokenizer_info)
        except Exception:  # WorkerGone once closed; anything else the first job reports
            pass
        finally:
            self._first_started.set()
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
            current.wait_ready(tokenizer_info)
            return
        if current is not None:
            current.kill()  # reaped, its pipes closed
            with self._lock:
                self._processes.remove(current)
            self._local.process = None
        self._spawn().wait_ready(tokenizer_info)

    def _spawn(self) -> WorkerProcess:
        if self._closed:
            raise WorkerGone
        process = WorkerProcess()
        with self._lock:
            closed = self._closed
            if not closed:
                self._processes.append(process)
        if closed:
            process.kill()
            raise WorkerGone
        self._local.process = process
        return process
