"""CUDA graphs for decode steps: one captured model forward per rung of a batch-size ladder,
and one captured whole greedy step (forward, LM head, argmax) per rung.

A decode step launches a few kernels per layer, each tiny at small batch sizes, so launch
overhead dominates. ``DecodeGraphs`` captures the whole decode forward (Triton backend only)
once per ladder size over static input buffers; a step pads its batch to the next rung, copies
its tensors into the buffers and replays. Padding rows are harmless by construction: their
slot is -1 (the Triton KV store skips it) and their ``seq_len`` is 0 (decode attention gives a
zero output without reading the pool); their outputs are cut off.

Only the capture and replay need CUDA; the padding (``DecodeStaticInputs``) runs on any device,
which is how the CPU tests check it. Turn graphs off with ``enable_cuda_graph = false``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from asyncengine.executor.attention.torch_backend import AttentionBackend
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.executor.layers.model import LlamaModel

DEFAULT_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512)


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """The default rungs up to ``max_batch_size``, which is always the last rung."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    rungs = [size for size in DEFAULT_LADDER if size < max_batch_size]
    return [*rungs, max_batch_size]


def padded_size(ladder: list[int], num_decodes: int) -> int | None:
    """The smallest rung that holds ``num_decodes`` rows, or None when none does."""
    index = bisect.bisect_left(ladder, num_decodes)
    return ladder[index] if index < len(ladder) else None


class DecodeStaticInputs:
    """Fixed device buffers that a captured decode forward reads; refilled before each replay."""

    def __init__(
        self,
        max_batch_size: int,
        max_pages_per_row: int,
        page_size: int,
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        self.page_size = page_size
        self.max_pages = max_pages_per_row
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            (max_batch_size, max_pages_per_row), dtype=torch.int32, device=device
        )
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.sample_indices = torch.arange(max_batch_size, dtype=torch.int64, device=device)
        self._empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        self._empty_table = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self._cu_zero = torch.zeros(1, dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode-only batch into rows ``:n`` and turn rows ``n:size`` into padding."""
        n = batch.num_decodes
        width = batch.decode_block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        # Columns past ``width`` keep stale page ids: seq_lens keeps every read below them.
        self.block_table[:n, :width].copy_(batch.decode_block_table)
        self.seq_lens[:n].copy_(batch.decode_seq_lens)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()

    def fill_for_warmup(self, size: int, num_pool_pages: int) -> None:
        """Rows that read a full table of pool pages and write nothing.

        Autotuning runs during the warm-up, so it must see the longest work, not empty rows.
        """
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        device = self.block_table.device
        pages = torch.arange(self.max_pages, dtype=torch.int32, device=device) % num_pool_pages
        self.block_table[:size].copy_(pages.expand(size, -1))
        self.seq_lens[:size].fill_(self.max_pages * self.page_size)

    def batch(self, size: int) -> ForwardBatch:
        """A decode-only ``ForwardBatch`` of views ``[:size]`` into the buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            sample_indices=self.sample_indices[:size],
            page_size=self.page_size,
            num_extend_tokens=0,
            extend_block_table=self._empty_table,
            extend_seq_lens=self._empty_i32,
            extend_cu_seqlens_q=self._cu_zero,
            extend_max_q_len=0,
            extend_max_seq_len=0,
            decode_block_table=self.block_table[:size],
            decode_seq_lens=self.seq_lens[:size],
            decode_max_seq_len=self.max_pages * self.page_size,
        )


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden]: the graph's output buffer
    # the same step through the LM head and a greedy pick: the whole decode step, sampler
    # included, for a batch whose every row takes its logits' argmax (no logits kept)
    greedy: torch.cuda.CUDAGraph | None = None
    tokens: torch.Tensor | None = None  # [size] int64: that graph's output buffer


class DecodeGraphs:
    """Captured decode forwards of ``model`` at every ladder size; ``run`` replays one."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        max_batch_size: int,
        max_pages_per_row: int,
        page_size: int,
    ) -> None:
        from asyncengine.executor.attention.triton_backend import TritonBackend

        if model.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA model, not one on {model.device}")
        if not isinstance(backend, TritonBackend):
            # Padding rows rely on the Triton KV store skipping slot -1.
            raise RuntimeError("CUDA graphs need the Triton attention backend")
        self.model = model
        self.backend = backend
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.ladder = batch_size_ladder(max_batch_size)
        self.inputs = DecodeStaticInputs(max_batch_size, max_pages_per_row, page_size, model.device)
        self.num_pool_pages = k_caches[0].shape[0] // page_size
        self._captured: dict[int, _Captured] = {}

    def capture(self) -> None:
        """Warm up and capture every rung, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.ladder):
                self.inputs.fill_for_warmup(size, self.num_pool_pages)
                batch = self.inputs.batch(size)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile, autotune, and settle the allocator
                        self._forward(batch)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(batch)
                captured = _Captured(graph, hidden)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._greedy_step(batch)  # the LM head's and argmax's first launch
                torch.cuda.current_stream().wait_stream(stream)
                captured.greedy = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured.greedy, pool=pool):
                    captured.tokens = self._greedy_step(batch)
                self._captured[size] = captured
        torch.cuda.synchronize()

    def _greedy_step(self, batch: ForwardBatch) -> torch.Tensor:
        """The decode forward, the LM head (float32 logits, as ``ModelRunner`` samples them)
        and each row's first largest logit: what ``Sampler`` gives a plain greedy row."""
        return self.model.compute_logits(self._forward(batch)).argmax(dim=-1)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        metadata = self.backend.build_metadata(batch)
        return self.model.forward(batch, self.backend, metadata, self.k_caches, self.v_caches)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode-only, every decode sampled, within the largest rung and the table width."""
        return (
            bool(self._captured)
            and batch.num_extend_tokens == 0
            and 0 < batch.num_decodes <= self.ladder[-1]
            and batch.sample_indices.shape[0] == batch.num_decodes
            and batch.decode_block_table.shape[1] <= self.inputs.max_pages
        )

    def run_greedy(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the whole greedy step of the rung that holds the batch: each row's token
        (int64 ``[n]``, on the device; a view of the graph's buffer, valid until the next
        replay). For batches whose every row is a plain greedy one (``Sampler.plain_greedy``)."""
        size = padded_size(self.ladder, batch.num_decodes)
        assert size is not None and size in self._captured, "call can_run() first"
        captured = self._captured[size]
        assert captured.greedy is not None and captured.tokens is not None
        self.inputs.fill(batch, size)
        captured.greedy.replay()
        return captured.tokens[: batch.num_decodes]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the rung that holds the batch; the sampled rows' hidden states ``[n, hidden]``."""
        size = padded_size(self.ladder, batch.num_decodes)
        assert size is not None and size in self._captured, "call can_run() first"
        self.inputs.fill(batch, size)
        captured = self._captured[size]
        captured.graph.replay()
        return captured.hidden[: batch.num_decodes]
