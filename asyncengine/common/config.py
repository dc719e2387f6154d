"""EngineConfig: every knob of the engine, loadable from TOML with keyword overrides."""

from __future__ import annotations

import difflib
import functools
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from asyncengine.common.plugin_spec import anchor_config_paths
from asyncengine.common.sampling_params import LORA_NAME_RULE, is_lora_name
from asyncengine.speculative.settings import SpeculativeConfig, parse_speculative

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: a GGUF's quantized tensors stay as stored where the CPU has kernels for them (else they
# are expanded to dtype); none: expand every weight to dtype; int8: quantize a float
# checkpoint's weights per output row at load (CPU kernels only)
QUANTIZATIONS = ("auto", "none", "int8")
# the K/V pool's element (asyncengine/executor/kv_dtype.py says what auto picks and what is refused)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
DEVICES = ("auto", "cpu", "cuda")
# attention backends (asyncengine/executor/attention/selector.py says what each needs)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
EMBEDDING_POOLINGS = ("auto", "mean", "last")
# what happens to a running request retracted for KV memory (docs/ARCHITECTURE.md, Scheduling)
PREEMPTION_MODES = ("recompute", "swap")


class ConfigError(ValueError):
    """A config file or override that names an unknown key or holds a bad value."""


def key_value(text: str) -> tuple[str, Any]:
    """One ``KEY=VALUE`` command-line pair (an argparse ``type``): dashes in the key become
    underscores; the value is JSON when it parses (numbers, booleans, lists), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Engine configuration. Build it directly, or with ``EngineConfig.from_toml(path, **overrides)``.

    Sizes are in tokens unless the name says otherwise.
    """

    # the model
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU whichever of bf16/fp32 runs faster
    quantization: str = "auto"  # how weights are held: one of QUANTIZATIONS (see there)
    # bytes the dense copies of a model's quantized projections may take together (each built
    # by the first step of at least its crossover rows, then kept: faster many-row steps, at up
    # to ~3x a Q4_K_M file's bytes; executor/layers/linear.py; the int8 product's repacked
    # weights take from it too); past it a projection keeps its quantized products. None: on a
    # CPU half the memory available when the model is bound, less its weights
    # (executor/cpu/dense_budget.py); on a GPU no limit. A draft model has a budget of its own
    # (the number given; None: no limit)
    dense_weight_bytes: int | None = None
    device: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # the most tokens one request may ask to generate (None: up to the context); a request
    # asking for more is refused (HTTP 400), one asking for nothing gets at most this many
    max_new_tokens_limit: int | None = None
    seed: int = 0

    # KV memory
    page_size: int = 16
    kv_cache_tokens: int | None = None  # KV pool capacity; default 32768 on CPU, see below on CUDA
    kv_cache_bytes: int | None = None
    # the pool's element: auto = on a CPU int8 beside bfloat16 activations (VNNI dot products) or
    # float16 beside float32 ones of quantized weights (AVX2 + F16C), else the model's dtype; or
    # one of KV_CACHE_DTYPES that can be honoured (executor/kv_dtype.py)
    kv_cache_dtype: str = "auto"
    max_loras: int = 4  # distinct LoRA adapters in one step (the base model counts as none)
    # LoRA adapters served over the base model: name -> PEFT directory (executor/lora/), picked
    # per request by SamplingParams.lora (the OpenAI "model" field)
    loras: dict[str, str] = {}
    max_lora_rank: int = 64  # an adapter of a higher rank is refused at load
    # adapters kept in memory besides those of requests in flight; the least recently used
    # beyond this are dropped and read back from disk when a request for one arrives (None:
    # every adapter stays loaded)
    max_cpu_loras: int | None = None
    # on CUDA with neither size given: the share of the GPU's memory the engine may fill; the
    # pool takes what the weights and an activation reserve leave of it (vLLM's meaning)
    gpu_memory_utilization: float = 0.9
    enable_prefix_cache: bool = True
    # scored prompt pages (prompt logprobs) kept so a prompt sharing a scored prefix computes
    # only the rest (cache/prompt_scores.py); 0 turns it off. A page of k=1 scores is ~3 KB.
    prompt_score_cache_pages: int = 4096

    # scheduling
    policy: str = "fcfs"  # a name, "a+b" to compose an ordering with a budget, or "pkg.mod:Class"
    policy_options: dict[str, Any] = {}
    max_running_requests: int = 128
    max_waiting_requests: int = 4096
    max_prefill_tokens: int = 4096  # prefill tokens per step (and at most one chunk when chunking)
    chunked_prefill_size: int = 1024  # longest prefill chunk; 0 turns chunking off
    # while a long prompt is mid-chunk, waiting prompts of at most this many uncached tokens
    # join its steps, taken from its chunk (at most half of it): a short request does not wait
    # for a long prompt's whole prefill; 0 keeps a step to the one prompt mid-chunk
    short_prompt_tokens: int = 256
    enable_mixed_batch: bool = True  # decodes ride along with a prefill chunk in one forward
    max_consecutive_prefill_steps: int = 4  # then a decode step, so decodes are never starved
    policy_window: int = 128  # the policy orders at most this many oldest waiting requests
    # a waiting prompt that shares an uncached page with a prompt admitted in the same step
    # waits a step and takes it from the prefix cache instead of computing it again
    enable_inbatch_prefix_dedup: bool = True
    # a prompt that goes on with the same uncached tokens as another prompt of the same step
    # copies their KV (and prompt scores) in that forward instead of computing them, and does
    # not wait a step for a sibling's kept tail page (step_shares.py)
    enable_in_step_prefix_sharing: bool = True
    # waiting requests admission may pass over in one step because their pages do not fit in
    # KV memory, to admit smaller ones behind them (0: the first that does not fit stops it,
    # strict policy order; vLLM #33499 skips them all). A skipped request keeps its place.
    kv_blocked_skips: int = 0
    # seconds a request may wait before it is first scheduled; then it ends with reason
    # "timeout" (None: no limit). A request's own SamplingParams.timeout bounds its whole life.
    max_queue_time: float | None = None
    # seconds the policy may admit nothing while requests wait and nothing runs (a batching
    # window or pacing holds on purpose); past it the engine logs an error and FCFS takes over,
    # the simulator raises PolicyStalledError (scheduler/policy_guard.py); admission blocked by
    # something else (KV memory) past it is only logged, naming why. 0: no bound
    max_policy_stall: float = 30.0
    # a second policy asked to order the same waiting queue every step, without acting: the
    # engine reports how often its first pick and its top ``shadow_top_k`` agree with the live one
    shadow_policy: str | None = None
    # what POST /admin/policy may swap in besides the built-ins and their compositions: names,
    # "pkg.mod:Class" or "path/to/file.py:Class", loaded at start-up (a request never names code)
    allowed_policies: list[str] = []
    shadow_policy_options: dict[str, Any] = {}
    shadow_top_k: int = 4
    # which cached page goes first when the KV pool runs short (policies/eviction_registry.py):
    # lru, lfu, arc, queue-aware, cost-aware, "pkg.mod:Class" or "path/to/file.py:Class"
    eviction_policy: str = "lru"
    eviction_policy_options: dict[str, Any] = {}
    # what POST /admin/eviction-policy may swap in besides the built-ins (loaded at start-up)
    allowed_eviction_policies: list[str] = []
    # pinned prefixes (engine.pin, POST /v1/cache/pin) hold at most this share of the KV pool
    max_pinned_fraction: float = 0.25
    # KV shortage: which running request goes (policies/victims.py: newest, least-computed,
    # lowest-priority, largest-kv; a policy may choose otherwise) and what happens to its KV:
    # "recompute" (cached prefix kept, the rest computed again) or "swap" (copied to a host
    # buffer of swap_space_bytes and back on re-admission; recompute when it does not fit)
    preemption_victim: str = "newest"
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 1 << 30
    # a host-memory tier under the prefix cache: evicted pages are copied to the same host
    # buffer (swap_space_bytes, one allocator with swap preemption) and copied back on a hit
    # instead of being computed again (cache/host_tier.py)
    host_kv_tier: bool = False
    # predicts a request's output length for the policies that rank by it (sjf, ltr): a
    # built-in (policies/length_registry.py: max-tokens, oracle (simulator only), history,
    # ranker), "pkg.mod:Class" or "path/to/file.py:Class"
    length_predictor: str = "max-tokens"
    length_predictor_options: dict[str, Any] = {}
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001

    # executor
    # overlap scheduling: on an executor that fills in deferred decode inputs (a GPU's), plan
    # and launch step N+1 while step N runs, its tokens landed and streamed a step late where
    # that is exact (scheduler/plan_ahead.py; else, and on a CPU, the next forward launches
    # before this step's tokens stream). Off until measured faster on a GPU: the measurement is
    # scripts/gpu_check.sh's offline-overlap part; on a CPU the stand-in executor shows it
    # (scripts/micro/bench_host_step.py --device-ms 1.6 --overlap)
    enable_overlap_schedule: bool = False
    attention_backend: str = "auto"
    enable_cuda_graph: bool = True
    # a request's greedy output does not depend on the batch it runs in (batch-invariant
    # matmuls and attention, executor/deterministic.py); costs throughput, see docs/BENCHMARKS.md
    deterministic: bool = False
    # speculative decoding, off when None: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 4, "rule": "adaptive"} (speculative/settings.py)
    speculative: dict[str, Any] | None = None

    # requests
    max_n: int = 16  # most choices one request may ask for (n)
    # most logprob entries one request may ask for: scored positions (prompt and output) x
    # (alternatives + 1) x n, summed over a batch's prompts; more is refused (HTTP 400)
    max_logprob_entries: int = 1_000_000
    grammar_cache_size: int = 256  # compiled structured-output grammars kept, by spec
    grammar_compile_workers: int = 2  # processes compiling grammars (a queue behind them)
    # seconds a grammar may compile; then its request is refused (400) and so is its spec
    grammar_compile_timeout: float = 10.0
    # embeddings (asyncengine/common/pooling.py): "mean" or "last" token; "auto": the model dir's
    # sentence-transformers pooling (1_Pooling/config.json) when it has one, else "mean"
    embedding_pooling: str = "auto"
    # KV cache events for external routers (cache/kv_events.py): a ZMQ PUB endpoint such as
    # "tcp://127.0.0.1:5557" (None: off)
    kv_events: str | None = None
    # whether BlockStored events carry the pages' token ids (every prompt, to any subscriber);
    # off, they carry the chained page hashes only, which is what a router matches on
    kv_events_token_ids: bool = False

    # logging
    log_interval: float = 10.0  # seconds between one-line engine summaries; 0 turns them off

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"config key {key!r} = {getattr(self, key)!r}: {why}")

        # paths may come as pathlib.Path (EngineConfig(model=Path(...))): kept as strings
        if isinstance(self.model, os.PathLike):
            msgspec.structs.force_setattr(self, "model", os.fspath(self.model))
        if any(isinstance(path, os.PathLike) for path in self.loras.values()):
            loras = {name: os.fspath(path) for name, path in self.loras.items()}
            msgspec.structs.force_setattr(self, "loras", loras)
        for field in _fields():  # EngineConfig(...) itself converts nothing: say which is wrong
            try:
                msgspec.convert(getattr(self, field.name), field.type, strict=True)
            except msgspec.ValidationError as exc:
                raise bad(field.name, str(exc)) from None
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {', '.join(DEVICES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        if not self.model:
            raise bad("model", "must name a model or a path")
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise bad("embedding_pooling", f"must be one of {', '.join(EMBEDDING_POOLINGS)}")
        for key in (
            "page_size",
            "max_running_requests",
            "max_waiting_requests",
            "max_prefill_tokens",
            "max_consecutive_prefill_steps",
            "policy_window",
            "shadow_top_k",
            "max_n",
            "max_logprob_entries",
            "grammar_cache_size",
            "grammar_compile_workers",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, key) < 1:
                raise bad(key, "must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise bad("max_cpu_loras", "must be >= 1, or absent to keep every adapter loaded")
        for name in self.loras:
            if not is_lora_name(name):
                raise bad("loras", f"adapter name {name!r} must be {LORA_NAME_RULE}")
        if self.prompt_score_cache_pages < 0:
            raise bad("prompt_score_cache_pages", "must be >= 0 (0 turns it off)")
        if self.kv_blocked_skips < 0:
            raise bad("kv_blocked_skips", "must be >= 0 (0: stop at the first that does not fit)")
        if self.chunked_prefill_size < 0:
            raise bad("chunked_prefill_size", "must be >= 0 (0 turns chunking off)")
        if self.short_prompt_tokens < 0:
            raise bad("short_prompt_tokens", "must be >= 0 (0: none join a prompt mid-chunk)")
        if self.chunked_prefill_size and self.chunked_prefill_size < self.page_size:
            raise bad("chunked_prefill_size", f"must be 0 or >= page_size ({self.page_size})")
        if self.dense_weight_bytes is not None and self.dense_weight_bytes < 0:
            raise bad("dense_weight_bytes", "must be >= 0 (0: no dense copies)")
        for key in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len", "max_new_tokens_limit"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise bad(key, "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise bad("kv_cache_bytes", "give kv_cache_tokens or kv_cache_bytes, not both")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if not 0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise bad(
                "init_new_token_ratio", "need 0 < min_new_token_ratio <= init_new_token_ratio <= 1"
            )
        if not 0 <= self.new_token_ratio_decay < 1:
            raise bad("new_token_ratio_decay", "must be in [0, 1)")
        if not self.grammar_compile_timeout > 0:
            raise bad("grammar_compile_timeout", "must be > 0 seconds")
        if self.log_interval < 0:
            raise bad("log_interval", "must be >= 0")
        if self.max_queue_time is not None and not self.max_queue_time > 0:
            raise bad("max_queue_time", "must be > 0 seconds, or absent for no limit")
        if not self.max_policy_stall >= 0:
            raise bad("max_policy_stall", "must be >= 0 seconds (0: no bound)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise bad("preemption_mode", f"must be one of {', '.join(PREEMPTION_MODES)}")
        if not 0 <= self.max_pinned_fraction < 1:
            raise bad("max_pinned_fraction", "must be in [0, 1)")
        if self.swap_space_bytes < 0:
            raise bad("swap_space_bytes", "must be >= 0")
        if self.shadow_policy is None and self.shadow_policy_options:
            raise bad("shadow_policy_options", "needs a 'shadow_policy'")
        if self.speculative is not None:
            try:
                parse_speculative(self.speculative)
            except ValueError as exc:
                raise ConfigError(f"config key 'speculative': {exc}") from None
        # the policy names and options are checked where the policies are built, once
        # (asyncengine/core/builder.py make_policies), before any model loads

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        for key in values:
            if key not in cls.__struct_fields__:
                raise ConfigError(_unknown_key(key))
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad engine config: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path | None = None, **overrides: Any) -> EngineConfig:
        """Load ``path`` (top-level keys, or an ``[engine]`` table), then apply non-None
        overrides. A relative "file.py:Class" path in the file (a policy, an eviction rule, a
        length predictor), and a relative model or LoRA adapter path (plugin_spec.model_path),
        is relative to the file's folder; in ``overrides`` it stays as given."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    values = tomllib.load(f)
            except FileNotFoundError:
                raise ConfigError(f"config file not found: {path}") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
            if "engine" in values:
                extra = sorted(set(values) - {"engine"})
                if extra:
                    raise ConfigError(
                        f"config file {path}: unknown top-level keys {extra} beside [engine]"
                    )
                values = dict(values["engine"])
            values = anchor_config_paths(values, Path(path).resolve().parent)
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls.from_dict({**values, **given})
        except ConfigError as exc:
            if path is None:
                raise
            if given:  # the file alone: a mistake of the overrides' is not the file's
                try:
                    cls.from_dict(values)
                except ConfigError as own:
                    raise ConfigError(f"config file {path}: {own}") from None
                raise
            raise ConfigError(f"config file {path}: {exc}") from None

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """The checked ``speculative`` settings (None: speculation off)."""
        return None if self.speculative is None else parse_speculative(self.speculative)

    def replace(self, **changes: Any) -> EngineConfig:
        return EngineConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


@functools.cache
def _fields() -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(EngineConfig)


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, EngineConfig.__struct_fields__, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}"
