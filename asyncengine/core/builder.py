"""build_core: the one place an engine core is assembled, for any executor.

KV memory is sized here: from ``kv_cache_tokens`` or ``kv_cache_bytes`` when the config gives
one; else from the executor's ``kv_budget_bytes`` (a GPU executor offers what
``gpu_memory_utilization`` leaves); else ``DEFAULT_KV_TOKENS``. The context limit is the
smallest of the config's ``max_model_len``, the model's, and the pool; a ``max_model_len`` the
config sets past the pool is a ConfigError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.swap_space import SwapSpace
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.core.engine_core import EngineCore
from asyncengine.core.executor_api import Executor, KVLayout, ModelSpec
from asyncengine.policies.base import Policy
from asyncengine.policies.eviction_registry import build_eviction_rule, resolve_eviction_rule
from asyncengine.policies.length_predictor import LengthPredictions
from asyncengine.policies.length_registry import build_length_predictor
from asyncengine.policies.registry import build_policy, resolve_policy
from asyncengine.policies.victims import VICTIM_RULES
from asyncengine.scheduler.scheduler import Scheduler
from asyncengine.scheduler.shadow import ShadowPolicy

DEFAULT_KV_TOKENS = 32768

log = logging.getLogger("asyncengine.core.builder")


def kv_capacity_pages(config: EngineConfig, spec: ModelSpec, budget_bytes: int | None) -> int:
    """Pages of the KV pool: from kv_cache_bytes or kv_cache_tokens when given, else from
    ``budget_bytes`` (the executor's offer), else DEFAULT_KV_TOKENS."""
    page_size = config.page_size
    if config.kv_cache_tokens is not None:
        return -(-config.kv_cache_tokens // page_size)
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else budget_bytes
    if budget is None:
        return -(-DEFAULT_KV_TOKENS // page_size)
    pages = budget // (spec.kv_bytes_per_token * page_size)
    if pages < 1:
        key = "kv_cache_bytes" if config.kv_cache_bytes is not None else "gpu_memory_utilization"
        raise ConfigError(
            f"config key {key!r}: {budget} bytes hold no KV page "
            f"({spec.kv_bytes_per_token * page_size} bytes each)"
        )
    return pages


def kv_layout(config: EngineConfig, spec: ModelSpec, budget_bytes: int | None) -> KVLayout:
    num_pages = kv_capacity_pages(config, spec, budget_bytes)
    check_context_fits(config, spec, num_pages, budget_bytes)
    max_model_len = context_limit(config, spec, num_pages)
    return KVLayout(
        num_pages=num_pages,
        page_size=config.page_size,
        max_rows=config.max_running_requests,
        max_pages_per_row=-(-max_model_len // config.page_size),
        swap_pages=swap_pages(config, spec),
    )


def swap_pages(config: EngineConfig, spec: ModelSpec) -> int:
    """Pages of the host buffer for swapped-out KV (0 unless ``preemption_mode`` is "swap")."""
    if config.preemption_mode != "swap" and not config.host_kv_tier:
        return 0
    page_bytes = spec.kv_bytes_per_token * config.page_size
    pages = config.swap_space_bytes // page_bytes
    if pages < 1:
        raise ConfigError(
            f"config key 'swap_space_bytes' = {config.swap_space_bytes}: holds no KV page "
            f"({page_bytes} bytes each) for preemption_mode 'swap' or host_kv_tier"
        )
    return pages


def context_limit(config: EngineConfig, spec: ModelSpec, num_pages: int) -> int:
    """The longest sequence (prompt + output) the engine accepts."""
    wanted = config.max_model_len or spec.max_model_len
    return min(wanted, spec.max_model_len, num_pages * config.page_size)


POOL_SIZED_BY = (
    "what the KV pool holds (kv_cache_tokens, kv_cache_bytes or, on a GPU, "
    "gpu_memory_utilization size it)"
)


def _pool_sized_by(config: EngineConfig, budget_bytes: int | None) -> str:
    """The config key that sized the pool, as a phrase."""
    if config.kv_cache_tokens is not None:
        return f"kv_cache_tokens = {config.kv_cache_tokens}"
    if config.kv_cache_bytes is not None:
        return f"kv_cache_bytes = {config.kv_cache_bytes}"
    if budget_bytes is not None:
        return f"gpu_memory_utilization = {config.gpu_memory_utilization}"
    return f"the default of {DEFAULT_KV_TOKENS} tokens: kv_cache_tokens unset"


def check_context_fits(
    config: EngineConfig, spec: ModelSpec, num_pages: int, budget_bytes: int | None
) -> None:
    """ConfigError when the operator set ``max_model_len`` and the pool cannot hold one
    sequence that long (up to the model's context), as vLLM refuses: a server that starts
    with a shorter context than the one set is found out only by the requests it refuses.
    A context the config leaves to the model is cut to the pool (``warn_context_cut``)."""
    asked = config.max_model_len
    pool_tokens = num_pages * config.page_size
    if asked is None or min(asked, spec.max_model_len) <= pool_tokens:
        return
    wanted = min(asked, spec.max_model_len)
    wanted_bytes = -(-wanted // config.page_size) * config.page_size * spec.kv_bytes_per_token
    raise ConfigError(
        f"config key 'max_model_len' = {asked}: one sequence of {wanted} tokens does not fit "
        f"the KV pool of {pool_tokens} tokens ({_pool_sized_by(config, budget_bytes)}); set "
        f"'kv_cache_tokens' to at least {wanted} (a pool of {wanted_bytes / 1e9:.2f} GB) or "
        f"'max_model_len' to at most {pool_tokens}"
    )


def warn_context_cut(config: EngineConfig, spec: ModelSpec, served: int) -> None:
    """Say so when the config asks for a longer context than the model's (a warning:
    otherwise the first sign is a request refused for a limit below the one set), and when the
    pool cuts the model's own (an info line: /v1/models shows a context below the model
    card's). A context set past the pool is refused before this (``check_context_fits``)."""
    asked = config.max_model_len
    if asked is None:
        if served < spec.max_model_len:
            log.info(
                "the model's context of %d tokens is served as %d, %s",
                spec.max_model_len,
                served,
                POOL_SIZED_BY,
            )
        return
    if asked > served:
        log.warning("max_model_len %d is cut to %d tokens, the model's context", asked, served)


def make_policies(config: EngineConfig) -> tuple[Policy, ShadowPolicy | None]:
    """The policy and the shadow ``config`` names, built once; a bad name or option raises
    ConfigError naming its key. Drivers that load a model call it first, so a typo fails
    before the weights load."""
    if config.preemption_victim not in VICTIM_RULES:
        raise ConfigError(
            f"config key 'preemption_victim' = {config.preemption_victim!r}: "
            f"must be one of {', '.join(VICTIM_RULES)}"
        )
    build_length_predictor(config.length_predictor, config.length_predictor_options)  # checked
    policy = build_policy(config.policy, config.policy_options)
    build_eviction_rule(config.eviction_policy, config.eviction_policy_options)  # checked
    for allowed in config.allowed_eviction_policies:  # loaded now, never on a request
        try:
            resolve_eviction_rule(allowed)
        except ValueError as exc:
            raise ConfigError(
                f"config key 'allowed_eviction_policies' entry {allowed!r}: {exc}"
            ) from None
    for allowed in config.allowed_policies:  # the operator's plugins load now, not on a request
        try:
            resolve_policy(allowed)
        except ValueError as exc:
            raise ConfigError(f"config key 'allowed_policies' entry {allowed!r}: {exc}") from None
    if config.shadow_policy is None:
        return policy, None
    shadow = build_policy(config.shadow_policy, config.shadow_policy_options, "shadow_policy")
    return policy, ShadowPolicy(shadow, config.shadow_top_k)


def listed_at_start_up(config: EngineConfig) -> EngineConfig:
    """``config`` with the policy, shadow policy and eviction rule it starts with added to the
    lists a live swap may name (``allowed_policies``, ``allowed_eviction_policies``): they load
    at start-up like the lists, so a swap to a built-in can be undone, by spec or by name."""
    policies = list(config.allowed_policies)
    for spec in (config.policy, config.shadow_policy):
        if spec is not None and ":" in spec and spec not in policies:
            policies.append(spec)
    rules = list(config.allowed_eviction_policies)
    if ":" in config.eviction_policy and config.eviction_policy not in rules:
        rules.append(config.eviction_policy)
    return config.replace(allowed_policies=policies, allowed_eviction_policies=rules)


def build_core(
    config: EngineConfig,
    executor: Executor,
    clock: Callable[[], float] = time.monotonic,
    policies: tuple[Policy, ShadowPolicy | None] | None = None,
) -> EngineCore:
    """KV memory, policy and scheduler for ``config``, bound to ``executor`` (``policies``:
    what ``make_policies(config)`` gave, when the driver built them already)."""
    spec = executor.spec
    layout = kv_layout(config, spec, executor.kv_budget_bytes(config))
    kv = KVCacheManager(
        layout.num_pages,
        layout.page_size,
        max_rows=layout.max_rows,
        max_pages_per_row=layout.max_pages_per_row,
        enable_prefix_cache=config.enable_prefix_cache,
        kv_events=config.kv_events is not None,
        swap=SwapSpace(layout.swap_pages, spec.kv_bytes_per_token * layout.page_size)
        if layout.swap_pages
        else None,
        eviction_rule=build_eviction_rule(config.eviction_policy, config.eviction_policy_options),
        max_pinned_fraction=config.max_pinned_fraction,
        host_tier=config.host_kv_tier and config.enable_prefix_cache,
    )
    executor.bind(layout)
    policy, shadow = policies if policies is not None else make_policies(config)
    max_model_len = context_limit(config, spec, layout.num_pages)
    warn_context_cut(config, spec, max_model_len)
    predictor = build_length_predictor(config.length_predictor, config.length_predictor_options)
    scheduler = Scheduler(
        config, kv, policy, max_model_len, clock, shadow, LengthPredictions(predictor)
    )
    return EngineCore(scheduler, executor)
