"""Build everything an engine needs from its config: model, tokenizer, KV memory, scheduler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.cache.kv_pool import KVPool
from asyncengine.cache.manager import KVCacheManager
from asyncengine.config import ConfigError, EngineConfig
from asyncengine.executor.cpu_dtype import fastest_cpu_dtype
from asyncengine.executor.model_config import ModelConfig
from asyncengine.scheduler import Scheduler
from policies import make_policy

log = logging.getLogger("asyncengine.worker")

DEFAULT_KV_TOKENS = 32768
# Kept free on a GPU beside weights and KV pool: activations, CUDA graphs, the allocator's slack.
GPU_ACTIVATION_RESERVE = 2 << 30


@dataclass(slots=True)
class EngineParts:
    runner: Any  # ModelRunner, or any object with execute(plan) -> StepOutput
    scheduler: Scheduler
    kv: KVCacheManager
    tokenizer: Any  # asyncengine.executor.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    make_detokenizer: Callable[[bool, list[int]], Any]  # (skip_special_tokens, prompt_ids)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'device' = 'cuda': no CUDA device is available here")
    return torch.device(config.device)


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        if device.type == "cpu":
            return fastest_cpu_dtype()
        return torch.bfloat16
    if config.dtype == "float16" and device.type == "cpu":
        raise ConfigError(
            "config key 'dtype' = 'float16' is refused on CPU: float16 matmuls run ~300x slower there; "
            "use bfloat16 (fast) or float32 (exact)"
        )
    return getattr(torch, config.dtype)


def gpu_kv_budget_bytes(config: EngineConfig, device: torch.device, weight_bytes: int) -> int:
    """Bytes for the KV pool on a GPU: ``gpu_memory_utilization`` of its memory, less what is
    in use already (other processes included), the weights still to be moved there, and a
    reserve for activations."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(config.gpu_memory_utilization * total) - in_use - weight_bytes
    budget -= GPU_ACTIVATION_RESERVE
    if budget <= 0:
        gib = 2**30
        raise ConfigError(
            f"config key 'gpu_memory_utilization' = {config.gpu_memory_utilization}: leaves no "
            f"room for the KV pool ({total / gib:.1f} GiB on the GPU, {in_use / gib:.1f} GiB in "
            f"use, weights {weight_bytes / gib:.1f} GiB, reserve "
            f"{GPU_ACTIVATION_RESERVE / gib:.0f} GiB); raise it or set kv_cache_tokens"
        )
    return budget


def kv_capacity_pages(
    config: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | None = None,
    weight_bytes: int = 0,
) -> int:
    """Pages of the KV pool: from kv_cache_bytes or kv_cache_tokens when given; else, on CUDA,
    from the GPU's memory (``gpu_kv_budget_bytes``), and DEFAULT_KV_TOKENS elsewhere."""
    budget = config.kv_cache_bytes
    if budget is None and config.kv_cache_tokens is None and device is not None:
        if device.type == "cuda":
            budget = gpu_kv_budget_bytes(config, device, weight_bytes)
    if budget is not None:
        pages = KVPool.num_pages_for_bytes(
            budget,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            config.page_size,
            dtype,
        )
        if pages < 1:
            raise ConfigError(f"config key 'kv_cache_bytes' = {budget}: too small for one page")
        return pages
    return KVPool.num_pages_for_tokens(
        config.kv_cache_tokens or DEFAULT_KV_TOKENS, config.page_size
    )


def build_kv_memory(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int = 0,
) -> tuple[KVPool, KVCacheManager, int]:
    """The KV pool, its manager, and the context length they allow. ``weight_bytes``: the
    weights not yet on the device (a GPU pool is sized around them)."""
    num_pages = kv_capacity_pages(config, model_config, dtype, device, weight_bytes)
    max_model_len = min(
        config.max_model_len or model_config.max_model_len,
        model_config.max_model_len,
        num_pages * config.page_size,
    )
    pool = KVPool(
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        num_pages,
        config.page_size,
        dtype,
        device,
    )
    kv = KVCacheManager(
        num_pages,
        config.page_size,
        max_requests=config.max_running_requests,
        max_pages_per_request=-(-max_model_len // config.page_size),
        enable_prefix_cache=config.enable_prefix_cache,
    )
    return pool, kv, max_model_len


def build_engine_parts(config: EngineConfig) -> EngineParts:
    """Load the model and set up KV memory, sampler and scheduler (runs off the event loop)."""
    from asyncengine.executor.loader import load_hf_config, load_weights, resolve_model
    from asyncengine.executor.runner import ModelRunner
    from asyncengine.executor.sampler import Sampler
    from asyncengine.executor.tokenizer import IncrementalDetokenizer, Tokenizer

    started = time.perf_counter()
    device = pick_device(config)
    dtype = pick_dtype(config, device)
    path = resolve_model(config.model, dtype)
    model_config = ModelConfig.from_hf_dict(load_hf_config(path))
    tokenizer = Tokenizer(path)
    weights = load_weights(path, dtype)
    weight_bytes = sum(t.nbytes for t in weights.values())
    pool, kv, max_model_len = build_kv_memory(config, model_config, dtype, device, weight_bytes)
    eos_ids = list(dict.fromkeys([*tokenizer.eos_token_ids, *model_config.eos_token_ids]))
    sampler = Sampler(eos_token_ids=eos_ids, seed=config.seed)
    runner = ModelRunner(
        model_config,
        weights,
        pool,
        kv.page_table,
        dtype=dtype,
        device=device,
        backend=config.attention_backend,
        sampler=sampler,
        enable_cuda_graph=config.enable_cuda_graph,
        max_batch_size=config.max_running_requests,
    )
    del weights
    policy = make_policy(config.policy, config.policy_options)
    scheduler = Scheduler(config, kv, policy, eos_ids, max_model_len)
    log.info(
        "engine ready in %.1fs: model %s (%s, %s), KV %d pages x %d tokens (%.0f MiB), max_model_len %d, policy %s",
        time.perf_counter() - started,
        config.model,
        dtype,
        device,
        pool.num_pages,
        config.page_size,
        pool.nbytes / 2**20,
        max_model_len,
        policy.name,
    )

    def make_detokenizer(skip_special_tokens: bool, prompt_ids: list[int]) -> Any:
        return IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids
        )

    return EngineParts(
        runner=runner,
        scheduler=scheduler,
        kv=kv,
        tokenizer=tokenizer,
        model_name=config.model,
        max_model_len=max_model_len,
        vocab_size=model_config.vocab_size,
        make_detokenizer=make_detokenizer,
    )
