"""ModelRunner: BatchPlan -> flat tensors -> model forward over the KV pool -> logits -> sampler."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, SamplingInfo, StepOutput, TokenLogprobs
from asyncengine.common.pooling import SUM
from asyncengine.executor.attention.selector import (
    create_attention_backend,
    kernel_ops,
    resolve_backend_name,
)
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.cpu.malloc_reuse import keep_freed_memory
from asyncengine.executor.cpu.step_threads import StepThreads, run_on_chosen_threads, step_threads
from asyncengine.executor.cuda_graph import DecodeGraphs
from asyncengine.executor.deferred_inputs import LastSampled
from asyncengine.executor.deterministic import (
    ForwardParts,
    deterministic_parts,
    products_match_on_one_thread,
)
from asyncengine.executor.device import pick_dtype
from asyncengine.executor.forward_batch import ForwardBatch, HostStaging, build_forward_batch
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.executor.layers.model import LlamaModel
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader.load_threads import one_torch_thread
from asyncengine.executor.lora.lora_step import lora_step
from asyncengine.executor.lora.registry import LoraRegistry
from asyncengine.executor.prompt_logprobs import logits_and_scores
from asyncengine.executor.sampler import Sampler
from asyncengine.kernels.cpu.plan_threads import planning_for
from asyncengine.kernels.pool_pairs import pool_fits
from asyncengine.kernels.quant_formats import F32, QuantizedTensor
from asyncengine.kernels.reference.kv_int8_ref import SCALED_POOLS
from asyncengine.speculative.acceptance import accepted_prefix

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("asyncengine.runner")


class SamplerLike(Protocol):
    def sample(
        self, logits: torch.Tensor, sampling: list[SamplingInfo]
    ) -> tuple[Sequence[int] | torch.Tensor, list[TokenLogprobs | None]]: ...


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedTensor],
        kv_pool: KVPool,
        page_table: PageTable,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        backend: str = "torch",
        sampler: SamplerLike | None = None,
        enable_cuda_graph: bool = False,
        max_batch_size: int = 256,
        deterministic: bool = False,
        dense_weight_bytes: int | None = None,
        defer_huge_pages: bool = False,
        consume_weights: bool = False,
    ) -> None:
        """``page_table`` is the runner's own: each plan's page writes are applied to it before
        the forward (tests may also write it directly). ``backend``: "torch", "triton" or "auto"
        (see executor/attention/selector.py); ``sampler`` defaults to
        ``Sampler(eos_token_ids=model_config.eos_token_ids)``. ``enable_cuda_graph`` captures
        decode forwards up to ``max_batch_size`` requests (CUDA with the triton backend only;
        elsewhere it has no effect). ``deterministic``: batch-invariant forward
        (executor/deterministic.py); it replaces ``backend`` and turns CUDA graphs off.
        ``dense_weight_bytes``: the most the dense copies of quantized projections may take
        (executor/layers/linear.py's ``DenseBudget``; None: no limit). ``defer_huge_pages``:
        the weights' huge pages left to ``defer_one_time_work`` (executor/cpu/weight_arena.py).
        ``consume_weights``: the model takes each weight out of ``weights`` (``LlamaModel``)."""
        self.device = torch.device(device)
        self.dtype = pick_dtype(dtype, self.device)
        _check_pool(model_config, kv_pool, self.dtype)
        self.config = model_config
        self.kv_pool = kv_pool
        self.page_table = page_table
        # plans made ahead read their decodes' inputs from here (deferred_inputs.py)
        self.last_sampled = LastSampled(page_table.array.shape[0], self.device)
        self.page_size = kv_pool.page_size
        # a CUDA step's index arrays go up through pinned buffers reused across steps
        self._staging = HostStaging() if self.device.type == "cuda" else None
        if deterministic:
            parts = deterministic_parts(
                self.device,
                model_config.num_heads,
                kv_pool.k_cache(0),
                kv_pool.page_size,
            )
            self.backend_name = "torch"
        else:
            self.backend_name = resolve_backend_name(backend, self.device)
            parts = ForwardParts(
                create_attention_backend(backend, self.device),
                kernel_ops(self.backend_name, self.device),
            )
        self.backend = parts.backend
        with one_torch_thread():
            self.model = LlamaModel(
                model_config,
                weights,
                self.dtype,
                self.device,
                parts.ops,
                parts.row_block,
                dense_weight_bytes,
                defer_huge_pages,
                max_positions=page_table.max_pages_per_row * kv_pool.page_size,
                consume_weights=consume_weights,
            )
        # a verify step small enough for the fused decode step runs its positions as decode
        # rows there (forward_batch.py): at batch 1 the extend path cost 1.7-2.2x a decode step
        self.verify_decode_rows = min(
            native_decode.VERIFY_DECODE_MAX_ROWS, native_decode.max_rows(self.model.native_decode)
        )
        if self.device.type == "cpu":
            self.model.build_i8_every_row()  # on every thread, outside the load's one
            keep_freed_memory()  # the steps' large blocks reused, not faulted in each step
        # the CPU step's thread count, all or one, chosen by measuring steps (step_threads.py);
        # deterministic mode too where its products' bits do not follow the count
        self.step_threads: StepThreads | None = None
        if self.device.type == "cpu":
            self.step_threads = step_threads(torch.get_num_threads())
        if deterministic and self.step_threads is not None:
            if not products_match_on_one_thread(self.model, self.step_threads.most):
                log.warning(
                    "deterministic mode: a product's bits change with the thread count here; "
                    "every step runs on %d threads (slow beside other busy processes)",
                    self.step_threads.most,
                )
                self.step_threads = None
        self.k_caches = [kv_pool.k_cache(i) for i in range(model_config.num_layers)]
        self.v_caches = [kv_pool.v_cache(i) for i in range(model_config.num_layers)]
        self.sampler = sampler if sampler is not None else _default_sampler(model_config)
        # LoRA adapters the plans' segments may name (executor/lora/); None: the base alone
        self.loras: LoraRegistry | None = None
        if self.device.type == "cuda" and self.backend_name == "triton":
            self._warm_up_attention(max_batch_size)
        self.graphs: DecodeGraphs | None = None
        if enable_cuda_graph and self.device.type == "cuda" and self.backend_name == "triton":
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                self.k_caches,
                self.v_caches,
                max_batch_size,
                page_table.max_pages_per_row,
                self.page_size,
            )
            self.graphs.capture()

    def pack_float_rows(self) -> None:
        """A float32 model's projections (F32 rows) take the prepacked oneDNN product from 24
        rows (executor/layers/linear.py), packed at the first such call: pack them at start-up
        instead (the executor calls this once the loaded weights are let go, so that the copies
        do not stand beside them), so that the first prompt of 24 tokens or more (every scoring
        request of lm-eval's first batch) does not wait for it. Other formats are not packed
        here: with float32 activations they go dense only past any step's rows; with bfloat16
        ones (linear.py's bfloat16 table, from 16-32 rows) the first such call builds the copy
        (~0.3 s CPU for SmolLM2, +208 MB), which an idle server or a single stream never pays."""
        model = self.model
        projections = [
            linear
            for layer in model.layers
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        for linear in [*projections, model.lm_head]:
            if (
                isinstance(linear, QuantizedLinear)
                and linear.dense_from_rows is not None
                and all(part.format == F32 for part in linear.parts)
                and linear.dense_allowed(torch.float32)
            ):
                linear.dense(torch.float32)

    def defer_one_time_work(self) -> Callable[[], bool] | None:
        """The weights' move into huge pages, then the model's int8 panels, left to be done
        between steps (``LlamaModel.deferred_huge_pages``, ``defer_panels``: the function that
        does a piece, True while more remains); None: nothing deferred."""
        if self.device.type != "cpu":
            return None
        pieces = deque(
            work
            for work in (self.model.deferred_huge_pages(), self.model.defer_panels())
            if work is not None
        )
        if not pieces:
            return None

        def step() -> bool:
            if not pieces[0]():
                pieces.popleft()
            return bool(pieces)

        return step

    def _warm_up_attention(self, max_batch_size: int) -> None:
        """Autotune the attention kernels for every length class now, not on first requests."""
        from asyncengine.executor.attention.triton_backend import TritonBackend

        assert isinstance(self.backend, TritonBackend)
        start = time.perf_counter()
        with torch.inference_mode():
            runs = self.backend.warm_up(
                self.k_caches[0],
                self.v_caches[0],
                self.config.num_heads,
                self.page_size,
                max_batch_size,
                self.page_table.max_pages_per_row * self.page_size,
                self.dtype,
            )
        torch.cuda.synchronize(self.device)
        log.info(
            "attention kernels warmed up for %d autotuning keys in %.1f s",
            len(runs),
            time.perf_counter() - start,
        )

    def prepare(self, plan: BatchPlan) -> ForwardBatch:
        longest = max((s.end_pos for s in plan.segments), default=0)
        if longest > self.config.max_model_len:
            raise ValueError(
                f"a sequence reaches {longest} tokens, past the model's {self.config.max_model_len}"
            )
        self.page_table.apply(plan.page_writes)
        if plan.page_copies:  # kept tail pages copied on write, before the forward writes KV
            self.kv_pool.copy_pages(plan.page_copies)
        batch = build_forward_batch(
            plan,
            self.page_table.array,
            self.page_size,
            self.device,
            self._staging,
            verify_decode_rows=self.verify_decode_rows,
        )
        self.last_sampled.fill(batch)
        return batch

    def forward_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Float32 logits [num_sampled, vocab] at the last token of each segment with sample=True."""
        with torch.inference_mode():
            batch = self.prepare(plan)
            return self._forward(batch, plan).logits

    def _forward(self, batch: ForwardBatch, plan: BatchPlan) -> ForwardResult:
        """One forward: the sampled rows' float32 logits, the scored prompt tokens' logprobs
        (prompt_logprobs.py) and each pooled segment's part (pooling.py). The model returns the
        final hidden states of the sampled rows, then the scored ones, then the pooled ones."""
        if batch.num_tokens == 0:
            empty = torch.empty(
                (0, self.config.vocab_size), dtype=torch.float32, device=self.device
            )
            return ForwardResult(empty)
        pool_rows, pool_spans = pooled_rows(plan)
        lora = None if self.loras is None else lora_step(plan, self.loras, self.device)
        if (
            not pool_rows
            and lora is None
            and batch.kv_copies is None
            and self.graphs is not None
            and self.graphs.can_run(batch)
        ):
            hidden = self.graphs.run(batch)
        else:
            rows = batch.hidden_rows
            if pool_rows:
                extra = torch.tensor(pool_rows, dtype=rows.dtype, device=self.device)
                rows = torch.cat([rows, extra])
            metadata = self.backend.build_metadata(batch)
            hidden = self.model.forward(
                batch, self.backend, metadata, self.k_caches, self.v_caches, rows=rows, lora=lora
            )
        num_sampled = batch.sample_indices.shape[0]
        num_scored = 0 if batch.score_indices is None else batch.score_indices.shape[0]
        if num_scored:
            assert batch.score_indices is not None
            scorings = [s.scoring for s in plan.extends if s.scoring is not None]
            head_rows = hidden[: num_sampled + num_scored]
            position_rows: torch.Tensor | None = None
            if any(s.lead is not None for s in scorings):  # a row scored twice: logits once
                unique, position_rows = torch.unique(batch.score_indices, return_inverse=True)
                device = position_rows.device
                one_each = torch.zeros(unique.shape[0], dtype=torch.int64, device=device)
                # any copy of a row will do: the copies are the same hidden state
                one_each[position_rows] = torch.arange(
                    num_sampled, num_sampled + num_scored, device=device
                )
                head_rows = torch.cat([hidden[:num_sampled], hidden[one_each]])
            # the sampled and the scored rows through the LM head in one product
            both = logits_and_scores(
                head_rows, num_sampled, scorings, self.model.compute_logits, rows=position_rows
            )
            result = ForwardResult(both.logits, both.scores)
        else:
            result = ForwardResult(self.model.compute_logits(hidden[:num_sampled]))
        if pool_rows:
            pooled_hidden = hidden[num_sampled + num_scored :].float()
            parts = [pooled_hidden[start:end].sum(dim=0) for start, end in pool_spans]
            result.pooled = torch.stack(parts).cpu().tolist()
        return result

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Forward the plan and sample one token per entry of ``plan.sampling``, plan order."""
        if self.step_threads is None:
            return self._execute(plan)
        # the kernels' split-K pieces planned for all threads on either count: the same bits
        with planning_for(self.step_threads.most):
            return run_on_chosen_threads(
                self.step_threads,
                plan.num_tokens,
                bool(plan.extends),
                lambda: self._execute(plan),
                torch.set_num_threads,
                time.perf_counter,
                time.process_time,
            )

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """``execute`` in two halves: this one starts the step and returns the wait for its
        output. A plain greedy decode step replayed as one CUDA graph returns as soon as it is
        enqueued (its tokens copied to pinned host memory behind it), so that the caller can
        enqueue the next step before this one's tokens reach the host; any other step runs
        whole here and the wait returns its output."""
        if self.step_threads is not None:
            output = self.execute(plan)
            return lambda: output
        return self._launch(plan)

    def _execute(self, plan: BatchPlan) -> StepOutput:
        return self._launch(plan)()

    def _launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        start = time.perf_counter()
        with torch.inference_mode():
            batch = self.prepare(plan)
            if batch.sample_indices.shape[0] != len(plan.sampling):
                raise ValueError(
                    f"plan {plan.step} samples {batch.sample_indices.shape[0]} segments but "
                    f"carries {len(plan.sampling)} SamplingInfo entries"
                )
            if plan.num_guesses:
                batch.sample_indices = rows_with_logits(plan, batch.sample_indices.device)
                result = self._forward(batch, plan)
                output = self._verify(plan, result.logits)
                output.forward_seconds = time.perf_counter() - start
                output.prompt_logprobs = result.prompt_logprobs
                output.pooled = result.pooled
                return lambda: output
            greedy = self._greedy_graph_step(batch, plan)
            if greedy is not None:  # forward, LM head and argmax replayed as one graph
                self.last_sampled.record(batch, greedy)
                return _tokens_when_ready(greedy, start)
            result = self._forward(batch, plan)
            ids: list[int] = []
            logprobs: list[TokenLogprobs | None] = []
            if plan.sampling:
                token_ids, sampled_logprobs = self.sampler.sample(result.logits, plan.sampling)
                self.last_sampled.record(batch, token_ids)
                ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
                logprobs = list(sampled_logprobs)
        output = StepOutput(
            ids,
            logprobs,
            time.perf_counter() - start,
            prompt_logprobs=result.prompt_logprobs,
            pooled=result.pooled,
        )
        return lambda: output

    def _greedy_graph_step(self, batch: ForwardBatch, plan: BatchPlan) -> torch.Tensor | None:
        """The tokens of a decode-only step whose every row is a plain greedy one, from the
        captured whole step (executor/cuda_graph.py); None: the step takes the general path."""
        graphs, sampler = self.graphs, self.sampler
        if (
            graphs is None
            or batch.kv_copies is not None
            or plan.extends
            or not plan.sampling
            or not isinstance(sampler, Sampler)
            or not graphs.can_run(batch)
            or not sampler.plain_greedy(plan.sampling)
        ):
            return None
        return graphs.run_greedy(batch)

    def _verify(self, plan: BatchPlan, logits: torch.Tensor) -> StepOutput:
        """Speculative decoding: a token sampled at every position of each verified row (under
        the row's state as if the guesses before it were accepted), then each row keeps its
        guesses up to the first disagreement (speculative/acceptance.py says why that is exact)."""
        sampled_segments = [seg for seg in plan.segments if seg.sample]
        rows: list[SamplingInfo] = []
        for seg, info in zip(sampled_segments, plan.sampling, strict=True):
            rows.append(info)
            guesses = seg.input_ids[len(seg.input_ids) - seg.guesses :]
            masks = info.guess_bitmasks or [None] * seg.guesses
            for j in range(1, seg.guesses + 1):
                rows.append(
                    SamplingInfo(
                        info.params,
                        info.prompt_ids,
                        info.output_ids,
                        masks[j - 1],
                        guessed_ids=guesses[:j],
                    )
                )
        token_ids, logprobs = self.sampler.sample(logits, rows)
        tokens = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        output = StepOutput([], [])
        offset = 0
        for seg in sampled_segments:
            guesses = seg.input_ids[len(seg.input_ids) - seg.guesses :]
            sampled = tokens[offset : offset + seg.guesses + 1]
            accepted = accepted_prefix(guesses, sampled)
            output.token_ids.append(sampled[accepted])
            output.logprobs.append(logprobs[offset + accepted])
            output.accepted.append(accepted)
            output.accepted_logprobs.append(list(logprobs[offset : offset + accepted]))
            offset += seg.guesses + 1
        return output


@dataclass(slots=True)
class ForwardResult:
    """What one forward computed, before sampling."""

    logits: torch.Tensor  # [num_sampled, vocab] float32
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    pooled: list[list[float]] = field(default_factory=list)


def _tokens_when_ready(tokens: torch.Tensor, start: float) -> Callable[[], StepOutput]:
    """The wait for ``tokens`` (on the device, enqueued): copied behind the step into pinned
    host memory; the wait blocks on that copy alone (an event), not on later work."""
    host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def collect() -> StepOutput:
        copied.synchronize()
        ids = host.tolist()
        return StepOutput(ids, [None] * len(ids), time.perf_counter() - start)

    return collect


def pooled_rows(plan: BatchPlan) -> tuple[list[int], list[tuple[int, int]]]:
    """The flat token rows of the plan's pooled segments (extends come first in a forward, in
    plan order) and, per pooled segment, the span of those rows its part sums: all of its
    rows ("sum"), or its last one ("last")."""
    rows: list[int] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for seg in plan.extends:
        n = seg.num_tokens
        if seg.pool is not None:
            first = offset if seg.pool == SUM else offset + n - 1
            spans.append((len(rows), len(rows) + offset + n - first))
            rows.extend(range(first, offset + n))
        offset += n
    return rows, spans


def rows_with_logits(plan: BatchPlan, device: torch.device) -> torch.Tensor:
    """Flat token indices whose logits a step needs, plan order: the last position of each
    sampled segment, and before it, for a verified row, every position of its guesses (so a
    row with g guesses gives g + 1 rows of logits). Only for a plan laid out segment after
    segment (every decode run as an extend: forward_batch.py does so when a plan has guesses)."""
    indices: list[int] = []
    end = 0
    for seg in plan.segments:
        end += seg.num_tokens
        if seg.sample:
            indices.extend(range(end - 1 - seg.guesses, end))
    return torch.tensor(indices, dtype=torch.int64, device=device)


def _check_pool(config: ModelConfig, pool: KVPool, dtype: torch.dtype) -> None:
    """The pool fits the model: its layers and heads, and the model's dtype (or a narrower pool
    beside the activations kernels/pool_pairs.py allows: on a CPU, or int8 / fp8 on a GPU)."""
    on_cpu = pool.device.type == "cpu"
    narrow = (on_cpu or pool.dtype in SCALED_POOLS) and pool_fits(pool.dtype, dtype)
    expected = (
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        pool.dtype if narrow else dtype,
    )
    actual = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    if expected != actual:
        raise ValueError(
            f"KV pool (layers, kv_heads, head_dim, dtype)={actual} does not fit the model's {expected}"
        )


def _default_sampler(config: ModelConfig) -> SamplerLike:
    from asyncengine.executor.sampler import Sampler

    return Sampler(eos_token_ids=config.eos_token_ids)
