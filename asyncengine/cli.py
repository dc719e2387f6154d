"""The `asyncengine` command: serve, generate, chat."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

from asyncengine.api.event_loop import run
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.server.port import PortInUseError


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (an argparse ``type``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"key\": 1}}', got {text!r} (not JSON: {exc})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}"
        )
    return value


# (flag, config key, type, help); every flag overrides the key of the same name in --config
ENGINE_FLAGS: list[tuple[str, str, Any, str]] = [
    (
        "--model",
        "model",
        str,
        "model: 'smollm2-135m' (embedded default), an HF directory or a .gguf file",
    ),
    (
        "--policy",
        "policy",
        str,
        "scheduling policy: fcfs, lpm, dfs-weight, priority, sjf, fair, slo, token-budget, "
        "dynamic-chunking, 'a+b' to compose an ordering with a budget, or 'package.module:Class'",
    ),
    (
        "--policy-options",
        "policy_options",
        json_object,
        "the policy's options as a JSON object, as the config's [policy_options] table, e.g. "
        '\'{"aging": 0.5}\' (a composition: one object per part, \'{"lpm": {"aging": 0.5}}\')',
    ),
    (
        "--eviction-policy",
        "eviction_policy",
        str,
        "which cached KV page goes first when the pool runs short: lru (default), lfu, arc, "
        "queue-aware, cost-aware, or 'path/to/file.py:Class'",
    ),
    (
        "--eviction-policy-options",
        "eviction_policy_options",
        json_object,
        "the eviction rule's options as a JSON object, as [eviction_policy_options]",
    ),
    (
        "--max-pinned-fraction",
        "max_pinned_fraction",
        float,
        "the share of the KV pool pinned prefixes (POST /v1/cache/pin) may hold",
    ),
    (
        "--shadow-policy",
        "shadow_policy",
        str,
        "a second policy that orders the same queue without acting (agreement in stats/metrics)",
    ),
    (
        "--max-queue-time",
        "max_queue_time",
        float,
        "seconds a request may wait before it is first scheduled (then finish_reason timeout)",
    ),
    (
        "--dtype",
        "dtype",
        str,
        "auto (CPU: bf16 where it outruns fp32) | bfloat16 | float32 | float16 (CUDA)",
    ),
    ("--device", "device", str, "auto | cpu | cuda"),
    (
        "--quantization",
        "quantization",
        str,
        "auto (a GGUF's quantized weights kept as stored on the CPU) | none (expand to dtype) "
        "| int8 (quantize a float checkpoint per output row, CPU)",
    ),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--kv-cache-tokens", "kv_cache_tokens", int, "KV pool capacity in tokens"),
    ("--kv-cache-bytes", "kv_cache_bytes", int, "KV pool capacity in bytes (instead of tokens)"),
    (
        "--kv-cache-dtype",
        "kv_cache_dtype",
        str,
        "auto (on a CPU: int8 beside bfloat16 activations where the kernels take VNNI dot "
        "products, float16 beside float32 ones of quantized weights on an AVX2 build; else the "
        "model's dtype) | float32 | bfloat16 | float16 | int8 (float32 or bfloat16 activations, "
        "on a CPU or with the Triton kernels on CUDA: a scale per token and head, ~1.94x the "
        "tokens of bfloat16 in the same bytes) | fp8 (e4m3 with the same scales: CUDA, Triton, "
        "compute capability >= 8.9)",
    ),
    (
        "--gpu-memory-utilization",
        "gpu_memory_utilization",
        float,
        "CUDA, no KV size given: share of GPU memory for weights + KV pool + activations",
    ),
    (
        "--max-model-len",
        "max_model_len",
        int,
        "longest prompt + output (default: the model's; at most what the KV pool holds)",
    ),
    (
        "--max-new-tokens-limit",
        "max_new_tokens_limit",
        int,
        "most tokens one request may ask for; more is refused (default: up to the context)",
    ),
    (
        "--max-logprob-entries",
        "max_logprob_entries",
        int,
        "most logprobs one request may ask for: scored positions x (alternatives + 1) x n",
    ),
    ("--max-running-requests", "max_running_requests", int, "requests decoding at once"),
    (
        "--max-waiting-requests",
        "max_waiting_requests",
        int,
        "queued requests before new ones are refused",
    ),
    ("--max-prefill-tokens", "max_prefill_tokens", int, "prefill tokens per step"),
    (
        "--chunked-prefill-size",
        "chunked_prefill_size",
        int,
        "longest prefill chunk (0: no chunking)",
    ),
    (
        "--short-prompt-tokens",
        "short_prompt_tokens",
        int,
        "prompts this short join the steps of a long prompt mid-chunk (0: none)",
    ),
    (
        "--max-consecutive-prefill-steps",
        "max_consecutive_prefill_steps",
        int,
        "prefill-only steps in a row before a decode step",
    ),
    ("--attention-backend", "attention_backend", str, "auto | torch | triton | flashinfer"),
    (
        "--preemption-victim",
        "preemption_victim",
        str,
        "KV shortage: newest | least-computed | lowest-priority | largest-kv",
    ),
    ("--preemption-mode", "preemption_mode", str, "recompute | swap (KV to a host buffer)"),
    ("--swap-space-bytes", "swap_space_bytes", int, "host buffer for swapped-out KV"),
    (
        "--length-predictor",
        "length_predictor",
        str,
        "output lengths for sjf/ltr: max-tokens | history | ranker | pkg.mod:Class",
    ),
    (
        "--speculative",
        "speculative",
        json_object,
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    ),
    ("--seed", "seed", int, "seed of unseeded sampling"),
    ("--max-n", "max_n", int, "most choices (n) one request may ask for"),
    (
        "--log-interval",
        "log_interval",
        float,
        "seconds between summary log lines, written only when something changed (0: off)",
    ),
    (
        "--kv-events",
        "kv_events",
        str,
        "publish KV cache events (vLLM's shape) on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557",
    ),
    ("--embedding-pooling", "embedding_pooling", str, "auto | mean | last (/v1/embeddings)"),
    (
        "--prompt-score-cache-pages",
        "prompt_score_cache_pages",
        int,
        "scored prompt pages kept for prompts sharing a scored prefix (0: off)",
    ),
    ("--max-lora-rank", "max_lora_rank", int, "LoRA adapters of a higher rank are refused"),
    (
        "--max-cpu-loras",
        "max_cpu_loras",
        int,
        "LoRA adapters kept in memory; the least recently used others are read back on use",
    ),
]


def lora_pair(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of --lora (an argparse ``type``)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter dir), got {text!r}")
    return name, path


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (each flag overrides the same key of --config)")
    group.add_argument("--config", metavar="FILE", help="TOML engine config (see configs/)")
    for flag, key, kind, help_text in ENGINE_FLAGS:
        group.add_argument(flag, dest=key, type=kind, default=None, help=help_text)
    group.add_argument(
        "--no-prefix-cache",
        dest="enable_prefix_cache",
        action="store_const",
        const=False,
        default=None,
        help="turn the radix prefix cache off",
    )
    group.add_argument(
        "--no-mixed-batch",
        dest="enable_mixed_batch",
        action="store_const",
        const=False,
        default=None,
        help="never put decodes and a prefill chunk in one forward",
    )
    group.add_argument(
        "--overlap-schedule",
        dest="enable_overlap_schedule",
        action="store_const",
        const=True,
        default=None,
        help="plan and launch the next step while this one runs (GPU), or at least before "
        "streaming this step's tokens",
    )
    group.add_argument(
        "--kv-events-token-ids",
        dest="kv_events_token_ids",
        action="store_const",
        const=True,
        default=None,
        help="KV events carry each stored page's token ids (default: hashes only; any "
        "subscriber then reads every prompt)",
    )
    group.add_argument(
        "--host-kv-tier",
        dest="host_kv_tier",
        action="store_const",
        const=True,
        default=None,
        help="evicted prefix-cache pages go to a host buffer of swap_space_bytes and come back "
        "on a hit instead of being computed again",
    )
    group.add_argument(
        "--deterministic",
        dest="deterministic",
        action="store_const",
        const=True,
        default=None,
        help="a request's greedy output does not depend on the batch it shares (slower)",
    )
    group.add_argument(
        "--allow-policy",
        dest="allowed_policies",
        action="append",
        default=None,
        metavar="NAME_OR_PATH",
        help="a policy POST /admin/policy may swap in besides the built-ins, e.g. "
        "'my_policy.py:Mine' (repeatable; loaded at start-up)",
    )
    group.add_argument(
        "--lora",
        dest="lora_pairs",
        action="append",
        type=lora_pair,
        default=None,
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter at PATH as model NAME (repeatable; beside --config's "
        "loras)",
    )
    group.add_argument(
        "--allow-eviction-policy",
        dest="allowed_eviction_policies",
        action="append",
        default=None,
        metavar="NAME_OR_PATH",
        help="an eviction rule POST /admin/eviction-policy may swap in besides the built-ins "
        "(repeatable; loaded at start-up)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    keys = [key for _, key, _, _ in ENGINE_FLAGS] + [
        "enable_prefix_cache",
        "enable_mixed_batch",
        "enable_overlap_schedule",
        "kv_events_token_ids",
        "deterministic",
        "host_kv_tier",
        "allowed_policies",
        "allowed_eviction_policies",
    ]
    config = EngineConfig.from_toml(args.config, **{k: getattr(args, k) for k in keys})
    pairs = getattr(args, "lora_pairs", None)
    if pairs:
        config = config.replace(loras={**config.loras, **dict(pairs)})
    return config


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="seed this request's sampling"
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=list(args.stop),
    )


async def _generate(config: EngineConfig, prompt: str, params: SamplingParams, chat: bool) -> None:
    from asyncengine.api.engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        request: Any = [{"role": "user", "content": prompt}] if chat else prompt
        last = None
        async for delta in engine.stream(request, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            last = delta
        sys.stdout.write("\n")
        if last is not None and last.usage is not None and last.metrics is not None:
            m, u = last.metrics, last.usage
            tps = u.completion_tokens / m.e2e if m.e2e else 0.0
            print(
                f"[{last.finish_reason}] prompt {u.prompt_tokens} tokens, output {u.completion_tokens} tokens, "
                f"ttft {m.ttft or 0:.3f}s, {tps:.1f} tok/s",
                file=sys.stderr,
            )


async def _chat(config: EngineConfig, params: SamplingParams, system: str | None) -> None:
    from asyncengine.api.engine import AsyncEngine

    async with AsyncEngine(config) as engine:
        history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            reply = []
            async for delta in engine.stream(history, params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                reply.append(delta.text)
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})


_imports_frozen: list[bool] = []  # main() ran once in this process: its imports frozen then


@contextlib.contextmanager
def collector_paused_for_imports() -> Iterator[None]:
    """The garbage collector off while the commands' modules (torch among them) are imported,
    and the first time, their objects frozen after: the imports made it walk a growing heap of
    ~100k objects in full collections, ~0.3 s of CPU a start, and objects made once and kept for
    the process's life need no later collection to walk them either. Once: a process calling
    ``main`` again (the tests) does not freeze what it made between the calls."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not _imports_frozen:
            gc.freeze()
            _imports_frozen.append(True)
        if enabled:
            gc.enable()


def build_parser() -> argparse.ArgumentParser:
    """The command line of every command (importing the server's modules for their options)."""
    parser = argparse.ArgumentParser(prog="asyncengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible and native HTTP server")
    add_engine_arguments(serve)
    from asyncengine.server.ray_serve.serve import add_ray_arguments
    from asyncengine.server.serve import add_serve_arguments

    add_serve_arguments(serve)
    add_ray_arguments(serve)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    add_engine_arguments(gen)
    add_sampling_arguments(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)

    for interactive in (gen, chat):
        interactive.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="show the engine's INFO log lines (loading, summaries) beside the text",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    with collector_paused_for_imports():
        parser = build_parser()
    from asyncengine.server.ray_serve.serve import serve_replicas, uses_ray
    from asyncengine.server.serve import serve as serve_http

    args = parser.parse_args(argv)
    # generate and chat write the model's text to the terminal: only warnings join it there
    quiet = args.command != "serve" and not args.verbose
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = engine_config_from_args(args)
        if args.command == "serve":
            return serve_replicas(config, args) if uses_ray(args) else serve_http(config, args)
        params = sampling_from_args(args)
        if args.command == "generate":
            run(_generate(config, args.prompt, params, args.chat))
        else:
            run(_chat(config, params, args.system))
    except (ConfigError, InvalidRequestError, ValueError, PortInUseError) as exc:
        print(f"asyncengine: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
