"""A quantized projection's parts as the kernels take them, each byte written once at load.

A projection's parts of one format are merged (q/k/v, gate/up: one kernel call) and laid out in
interleaved row groups (kernels/cpu/cpu_quant_blocks.h), in the weight arena where there is one
(executor/cpu/weight_arena.py). Done as three copies (``torch.cat``, the interleave, the arena)
that was most of a 1B GGUF's start-up; here one native call per merged part reads the rows where
they lie (the file's memory map) and writes them, interleaved, into their final place, on every
core the process has (kernels/cpu/cpu_weight_pack.c). The bytes are those of the three copies.

The parts are written in slices of ~``DROP_EVERY_BYTES``, the file's pages each slice read
dropped after it (loader/gguf_file.py): the process never holds the whole file and its packed
copy at once (a 1.5B Q4_K_M's load peaked at 2.4 GB with both, 1.4 GB without).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from asyncengine.executor.cpu.weight_arena import WeightArena
from asyncengine.executor.loader.gguf_file import drop_tensor_pages
from asyncengine.executor.loader.load_threads import native_load_threads
from asyncengine.kernels.cpu import weight_pack_native
from asyncengine.kernels.cpu.weight_pack_native import PackJob, RowSource
from asyncengine.kernels.quant_formats import INTERLEAVED_FORMATS, QuantizedTensor


def same_format_runs(parts: Sequence[QuantizedTensor]) -> list[list[QuantizedTensor]]:
    """Adjacent parts of one format, together (each run becomes one part)."""
    runs: list[list[QuantizedTensor]] = []
    for part in parts:
        if runs and runs[-1][0].format == part.format:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def pack_parts(
    parts: Sequence[QuantizedTensor], arena: WeightArena | None, interleave: bool
) -> list[QuantizedTensor] | None:
    """Each run of one format as one part, in interleaved groups where ``interleave`` and its
    format has them, in ``arena`` (written by ``write_pending``), else a tensor of its own
    (written now). None where the native packer cannot do it (no library; a part interleaved
    already): the caller takes the torch path."""
    if not weight_pack_native.available() or any(p.interleaved for p in parts):
        return None
    packed = []
    for run in same_format_runs(parts):
        fmt, cols = run[0].format, run[0].cols
        grouped = interleave and fmt.name in INTERLEAVED_FORMATS
        if arena is None and not grouped and len(run) == 1 and run[0].data.is_contiguous():
            packed.append(run[0])  # nothing to reorder, nowhere to move it: the bytes as given
            continue
        rows, row_bytes = sum(p.shape[0] for p in run), fmt.row_bytes(cols)
        if arena is not None:
            out = arena.take(rows, row_bytes)
        else:
            out = torch.empty((rows, row_bytes), dtype=torch.uint8)
        job = PackJob(fmt, tuple(RowSource(p.data) for p in run), cols, out, grouped)
        if arena is not None:
            arena.pending.append(job)  # written with every other part: ``write_pending``
        else:
            weight_pack_native.pack_many([job], native_load_threads())
        packed.append(QuantizedTensor(fmt, out, cols, interleaved=grouped))
    return packed


# Bytes written per native call before the file pages read are dropped: a few calls a model (a
# region per projection made each thread wait at ~70 ends; on a busy machine, each a thread
# descheduled), each small beside the file.
DROP_EVERY_BYTES = 128 << 20


def write_pending(arena: WeightArena) -> None:
    """Write every part handed a slice of ``arena`` and not yet written, a few native calls for
    the whole model (each one parallel region, its chunks handed to threads as they come free),
    dropping the file pages each call read. The parts' bytes are undefined until this returns."""
    threads = native_load_threads()
    # each batch's jobs are let go once written: a source no one else holds (a checkpoint's
    # tensor its model consumed) is freed then, not after the whole model is written
    jobs, arena.pending = deque(arena.pending), []
    batch: list[PackJob] = []
    size = 0
    while jobs:
        batch.append(jobs.popleft())
        size += batch[-1].out.numel()
        if size >= DROP_EVERY_BYTES:
            _write_and_drop(batch, threads)
            batch, size = [], 0
    _write_and_drop(batch, threads)


def _write_and_drop(jobs: list[PackJob], threads: int) -> None:
    if not jobs:
        return
    weight_pack_native.pack_many(jobs, threads)
    for job in jobs:
        for source in job.sources:
            drop_tensor_pages(source.data)
