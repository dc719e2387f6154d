"""ModelExecutor: the real model as an engine executor (asyncengine/core/executor_api.py).

    executor = ModelExecutor(config)          # device, dtype, model files, weights
    core = build_core(config, executor)       # sizes KV memory, then executor.bind(layout)
    output = executor.execute(plan)           # on the forward thread

It owns everything on the device side of a plan: the KV pool, its own page table (kept in step
with the KV manager's through each plan's page writes), the model and the sampler; with
speculative decoding by a draft model, the draft model and its own KV (speculative/draft/draft_model.py).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput
from asyncengine.core.builder import build_core
from asyncengine.core.engine_core import EngineCore
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.executor.cpu.dense_budget import default_dense_weight_bytes
from asyncengine.executor.cpu.pool_fit import check_pool_fits
from asyncengine.executor.device import pick_device, pick_dtype
from asyncengine.executor.host_kv_buffer import HostKVBuffer
from asyncengine.executor.kv_dtype import keeps_quantized_weights, pick_kv_dtype
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import load_hf_config
from asyncengine.executor.loader.gguf_file import drop_all_file_pages
from asyncengine.executor.loader.load_threads import one_torch_thread
from asyncengine.executor.loader.pooling_config import model_pooling
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.lora.peft_adapter import LoraLoadError
from asyncengine.executor.lora.registry import LoraRegistry
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.sampler import Sampler
from asyncengine.kernels.cpu import cpu_native, decode_step_native
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.policies.base import Policy
from asyncengine.scheduler.shadow import ShadowPolicy
from asyncengine.speculative.draft.draft_model import DraftModel, bind_draft_model, load_draft_model
from asyncengine.speculative.draft.draft_proposer import DraftProposer
from asyncengine.text.tokenizer import Tokenizer

log = logging.getLogger("asyncengine.executor")

# Kept free on a GPU beside weights and KV pool: activations, CUDA graphs, the allocator's slack.
GPU_ACTIVATION_RESERVE = 2 << 30


def gpu_kv_budget_bytes(utilization: float, device: torch.device, weight_bytes: int) -> int:
    """Bytes for the KV pool on a GPU: ``utilization`` of its memory, less what is in use
    already (other processes included), the weights still to be moved there, and a reserve for
    activations (vLLM's meaning of gpu_memory_utilization).

    Memory this process's torch allocator holds cached but unused counts as free: a second
    engine in one process (the first one stopped and dropped) reuses the first one's pool."""
    gc.collect()  # a dropped engine's pool, if only a reference cycle still holds it
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    in_use = total - free - cached
    budget = int(utilization * total) - in_use - weight_bytes - GPU_ACTIVATION_RESERVE
    if budget <= 0:
        gib = 2**30
        raise ConfigError(
            f"config key 'gpu_memory_utilization' = {utilization}: leaves no room for the KV "
            f"pool ({total / gib:.1f} GiB on the GPU, {in_use / gib:.1f} GiB in use, weights "
            f"{weight_bytes / gib:.1f} GiB, reserve {GPU_ACTIVATION_RESERVE / gib:.0f} GiB); "
            "raise it or set kv_cache_tokens"
        )
    return budget


class ModelExecutor:
    def __init__(self, config: EngineConfig, defer_huge_pages: bool = False) -> None:
        """``defer_huge_pages``: the weights' huge pages left to ``defer_one_time_work`` (the
        engine's start: executor/cpu/weight_arena.py)."""
        self.config = config
        self.defer_huge_pages = defer_huge_pages
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        with one_torch_thread():
            loaded = load_model(config.model, self.dtype, self.device, config.quantization)
        self.model_dir = loaded.model_dir
        self.weights_summary = loaded.summary()
        self.model_config = ModelConfig.from_hf_dict(load_hf_config(self.model_dir))
        self.pooling = model_pooling(self.model_dir, config.embedding_pooling)
        self._weights: dict[str, torch.Tensor | QuantizedTensor] | None = loaded.weights
        self.kv_dtype = pick_kv_dtype(
            config.kv_cache_dtype,
            self.device,
            self.dtype,
            quantized=keeps_quantized_weights(loaded.weights),
            deterministic=config.deterministic,
            backend=config.attention_backend,
            head_dim=self.model_config.head_dim,
        )
        self._eos_token_ids = list(self.model_config.eos_token_ids)
        self.runner: ModelRunner | None = None
        self.host_kv: HostKVBuffer | None = None  # swapped-out KV (preemption_mode "swap")
        # speculative decoding by a draft model: loaded now (a bad one is a config error before
        # any KV is sized), on the device at bind
        speculation = config.speculation
        self._draft: DraftModel | None = None
        if speculation is not None and speculation.method == "draft":
            self._draft = load_draft_model(config, self.model_dir, self.dtype, self.device)
        self.drafter: DraftProposer | None = None
        # plans may be made ahead of the step in flight (overlap scheduling), their decode
        # inputs filled in here: on a GPU, where the host would otherwise leave it idle; a CPU
        # forward needs the cores the host's planning would take, so it keeps the lock-step path
        self.defers_inputs = self.device.type == "cuda"
        # LoRA adapters, held in the model's dtype (the sums are float32 in every kernel)
        self.loras = LoraRegistry(
            self.model_config, config.max_lora_rank, config.max_cpu_loras, self.dtype, self.device
        )
        for name, path in config.loras.items():
            try:
                self.loras.add(name, path)
            except LoraLoadError as exc:
                raise ConfigError(f"config key 'loras' entry {name!r}: {exc}") from None
        if self.device.type == "cpu":  # compiled now (logged), not in the first request
            cpu_native.load_all(cpu_native.kv_flags(self.kv_dtype))
            decode_step_native.available(self.kv_dtype)  # the fused step's build for this pool

    def add_eos_token_ids(self, token_ids: list[int]) -> None:
        """More end-of-sequence ids (the tokenizer's); before ``bind``."""
        if self.runner is not None:
            raise RuntimeError("EOS ids are fixed once the executor is bound")
        self._eos_token_ids = list(dict.fromkeys([*token_ids, *self._eos_token_ids]))

    @property
    def spec(self) -> ModelSpec:
        mc = self.model_config
        return ModelSpec(
            max_model_len=mc.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=tuple(self._eos_token_ids),
            kv_bytes_per_token=KVPool.token_bytes(
                mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype
            ),
            pooling=self.pooling,
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights still to be moved to the device (0 once bound)."""
        if self._weights is None:
            return 0
        draft = 0 if self._draft is None else self._draft.weight_bytes
        return draft + sum(t.nbytes for t in self._weights.values())

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        """On a GPU, what ``gpu_kv_budget_bytes`` leaves (with a draft model, the target's
        share of it: the draft's pool has as many token slots); on a CPU None (the default)."""
        if self.device.type != "cuda":
            return None
        budget = gpu_kv_budget_bytes(config.gpu_memory_utilization, self.device, self.weight_bytes)
        if self._draft is None:
            return budget
        target = self.spec.kv_bytes_per_token
        return budget * target // (target + self._draft.kv_bytes_per_token(self.dtype))

    def bind(self, layout: KVLayout) -> None:
        if self._weights is None:
            raise RuntimeError("the executor is bound already")
        mc = self.model_config
        pool_bytes = self.spec.kv_bytes_per_token * layout.num_pages * layout.page_size
        if self.device.type == "cpu":
            check_pool_fits(self.config, pool_bytes, self.weight_bytes)
        pool = KVPool.for_model(mc, layout.num_pages, layout.page_size, self.kv_dtype, self.device)
        dense_bytes = self.config.dense_weight_bytes
        # only quantized (or stored float-row) projections make copies: a dense checkpoint's
        # are packed once whatever the budget, and a budget line would tell of copies it has not
        quantized = any(isinstance(w, QuantizedTensor) for w in self._weights.values())
        if dense_bytes is None and self.device.type == "cpu" and quantized:
            dense_bytes = default_dense_weight_bytes(self.weight_bytes, kv_pool_bytes=pool.nbytes)
        self.runner = ModelRunner(
            mc,
            self._weights,
            pool,
            PageTable(layout.max_rows, layout.max_pages_per_row),
            dtype=self.dtype,
            device=self.device,
            backend=self.config.attention_backend,
            sampler=Sampler(eos_token_ids=self._eos_token_ids, seed=self.config.seed),
            enable_cuda_graph=self.config.enable_cuda_graph,
            max_batch_size=self.config.max_running_requests,
            deterministic=self.config.deterministic,
            dense_weight_bytes=dense_bytes,
            defer_huge_pages=self.defer_huge_pages,
            consume_weights=True,  # the checkpoint's tensors go as their packed copies are made
        )
        self.runner.loras = self.loras
        self.host_kv = HostKVBuffer(pool, layout.swap_pages) if layout.swap_pages else None
        # the model holds its own copies now: the file's pages read go (loader/gguf_file.py)
        drop_all_file_pages()
        self._weights = None
        if self.device.type == "cpu":
            self.runner.pack_float_rows()
        if self._draft is not None:
            self.drafter = bind_draft_model(
                self._draft, layout, self.config, self.dtype, self.device, mc.vocab_size
            )
            log.info(
                "draft model %s (%d layers, hidden %d) for speculative decoding: KV pool %.0f MiB",
                self._draft.name,
                self._draft.config.num_layers,
                self._draft.config.hidden_size,
                self.drafter.runner.kv_pool.nbytes / 2**20,
            )
            self._draft = None
        log.info(
            "model %s (%s, %s, weights %s%s): KV pool %d pages x %d tokens, %s (%.0f MiB)",
            self.config.model,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.weights_summary,
            ", deterministic" if self.config.deterministic else "",
            layout.num_pages,
            layout.page_size,
            str(self.kv_dtype).removeprefix("torch."),
            pool.nbytes / 2**20,
        )

    def defer_one_time_work(self) -> Callable[[], bool] | None:
        """One-time work the first steps would do (huge pages, the int8 panels), left to be done a
        piece per call of the function returned, on the thread that runs ``execute`` (True while
        more remains); None: none."""
        return None if self.runner is None else self.runner.defer_one_time_work()

    def launch(self, plan: BatchPlan) -> Callable[[], StepOutput]:
        """``execute`` in two halves (``ModelRunner.launch``): a plain decode step is enqueued
        and the wait for its tokens returned; a step that swaps KV or drafts runs whole."""
        if self.runner is None:
            raise RuntimeError("bind() the executor before executing plans")
        if plan.swap_out or plan.swap_in or self.drafter is not None:
            output = self.execute(plan)
            return lambda: output
        return self.runner.launch(plan)

    def execute(self, plan: BatchPlan) -> StepOutput:
        if self.runner is None:
            raise RuntimeError("bind() the executor before executing plans")
        swap_seconds = 0.0
        if plan.swap_out or plan.swap_in:
            if self.host_kv is None:
                raise RuntimeError("a plan swaps KV but no swap space was laid out")
            swap_seconds = self.host_kv.run(plan.swap_out, plan.swap_in)
        if self.drafter is not None:
            output = self.drafter.execute(plan, self.runner.execute)
        else:
            output = self.runner.execute(plan)
        output.swap_seconds = swap_seconds
        return output


def model_core(
    config: EngineConfig, policies: tuple[Policy, ShadowPolicy | None] | None = None
) -> tuple[EngineCore, Tokenizer]:
    """The real model's core and its tokenizer (loads weights: off the event loop)."""
    executor = ModelExecutor(config, defer_huge_pages=True)  # the engine runs the deferred work
    tokenizer = Tokenizer(executor.model_dir)
    executor.add_eos_token_ids(tokenizer.eos_token_ids)
    return build_core(config, executor, policies=policies), tokenizer
