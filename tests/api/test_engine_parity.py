"""The whole engine against HF transformers: greedy tokens of concurrent requests are identical
under every policy, with prompts chunked several times, mixed batches on and off, and a KV pool
small enough to force retractions; the KV invariant holds after every step and nothing leaks."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.executor.loader import resolve_model
from asyncengine.policies import BUILTIN

VOCAB = 49152  # the default model's tokenizer, so the engine serves text too


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama that uses the embedded default model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny_chat")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    source = resolve_model("smollm2-135m", torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def hf_greedy(tiny_chat_model: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return run


def prompts(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    items = []
    for i in range(10):
        head = shared[: rng.randrange(8, 40)] if i % 3 else []
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 50))]
        items.append((head + tail, rng.randrange(16, 40)))
    return items


async def run_engine(
    model: Path, items: list[tuple[list[int], int]], **config: object
) -> tuple[list[list[int]], dict]:
    engine = AsyncEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            page_size=4,
            kv_cache_tokens=160,
            chunked_prefill_size=8,
            max_prefill_tokens=16,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.01,
            log_interval=0,
            **config,  # type: ignore[arg-type]
        )
    )
    async with engine:
        engine.step_hooks.append(lambda plan: engine.scheduler.kv.check_invariant())
        outs = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
                for p, n in items
            )
        )
        stats = engine.stats()
    return [o.token_ids for o in outs], stats


@pytest.fixture(scope="module")
def expected(hf_greedy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [hf_greedy(p, n) for p, n in prompts(seed=11)]


@pytest.mark.parametrize("policy", [*sorted(BUILTIN), "lpm+dynamic-chunking"])
@pytest.mark.parametrize("mixed", [True, False])
def test_engine_greedy_matches_hf(
    tiny_chat_model: Path, expected: list[list[int]], policy: str, mixed: bool
) -> None:
    items = prompts(seed=11)
    got, stats = asyncio.run(
        run_engine(tiny_chat_model, items, policy=policy, enable_mixed_batch=mixed)
    )
    assert got == expected
    assert stats["retractions"] > 0, "the KV pool was meant to be small enough to force retractions"
    assert (
        stats["pages_used"] == 0
        and stats["pages_free"] + stats["pages_cached"] + stats["pages_tail"]
        == stats["pages_total"]
    )
    assert stats["hit_tokens"] > 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm+dynamic-chunking"])
def test_engine_greedy_matches_hf_with_overlap_schedule(
    tiny_chat_model: Path, expected: list[list[int]], policy: str
) -> None:
    """The next forward launched before this step streams: same tokens, retractions included."""
    items = prompts(seed=11)
    got, stats = asyncio.run(
        run_engine(tiny_chat_model, items, policy=policy, enable_overlap_schedule=True)
    )
    assert got == expected
    assert stats["retractions"] > 0
    assert stats["pages_used"] == 0


@pytest.mark.parametrize("victim", ["newest", "least-computed", "lowest-priority", "largest-kv"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_swapped_out_kv_comes_back_exact(
    tiny_chat_model: Path, expected: list[list[int]], victim: str, prefix_cache: bool
) -> None:
    """Preempted requests' KV copied to the host buffer and back (float32, greedy): the same
    tokens as HF without preemption, and nothing recomputed. Without the prefix cache every
    page the requests get back comes from the host buffer."""
    got, stats = asyncio.run(
        run_engine(
            tiny_chat_model,
            prompts(seed=11),
            preemption_mode="swap",
            # room for every request's KV at once (1,024 pages of 4 tokens) and not the default
            # 1 GiB: the KV invariant checks each host page after every step
            swap_space_bytes=1 << 20,
            preemption_victim=victim,
            enable_prefix_cache=prefix_cache,
        )
    )
    assert got == expected
    assert stats["swap_outs"] == stats["retractions"] > 0 and stats["swap_ins"] > 0
    assert stats["recomputed_tokens"] == 0 and stats["swap_seconds"] > 0
    if not prefix_cache:
        assert stats["swapped_in_bytes"] == stats["swapped_out_bytes"]
