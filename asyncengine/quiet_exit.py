"""Keep Triton's exit noise off the terminal.

Triton's compiled module is built with nanobind, which prints ~30 lines of ``nanobind: leaked
... instances/types/functions`` when the interpreter shuts down with Triton imported (its module
objects outlive nanobind's bookkeeping; the leak check has no public switch). Nothing on the
engine's CPU path imports Triton, but torch's dynamo does (transformers imports it, and so do
the GPU kernels and their tests). At exit, once the program and every earlier exit handler have
finished, this points the process's stderr at /dev/null if Triton was imported, so the shutdown
stays quiet. Everything the program itself writes (tracebacks of uncaught exceptions included:
Python prints them before exit handlers run) is unaffected.
"""

from __future__ import annotations

import atexit
import os
import sys

_registered = False


def _silence_finalization_if_triton_loaded() -> None:
    if "triton" not in sys.modules:
        return
    try:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except (OSError, ValueError):  # stderr already closed or replaced: nothing to silence
        pass


def install() -> None:
    """Register the exit handler once. Registered at import of ``asyncengine``, it runs after
    every handler registered later (exit handlers run last-in, first-out)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_silence_finalization_if_triton_loaded)
