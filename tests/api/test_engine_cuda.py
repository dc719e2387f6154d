"""The whole engine on a CUDA GPU (skipped without one): Triton kernels compiled, decode CUDA
graphs on, the KV pool sized from the GPU's memory; greedy tokens equal HF generate's, also with
ngram speculation (verify steps) and with overlap scheduling; prompt logprobs equal HF's, also
when a second round hits the prefix cache and its kept partial pages (page copies on the GPU)
and when choices sent together share their context inside one forward (K/V copied per layer).

The engine runs in a fresh interpreter: tests/conftest.py puts Triton in interpreter mode for
this process. A CPU twin of the script (torch backend) keeps it from rotting where there is no
GPU.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyCheckpoint
from tests.python_subprocess import run_python

_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, shutil, sys
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM
    from asyncengine import AsyncEngine, EngineConfig, SamplingParams

    source, work, device = sys.argv[1], sys.argv[2], sys.argv[3]
    shutil.copytree(source, work)
    # The tiny checkpoint has no tokenizer; the engine needs one even for token-id prompts.
    vocab = {f"t{i}": i for i in range(96)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(f"{work}/tokenizer.json")
    json.dump({"eos_token": "t2", "bos_token": "t1"}, open(f"{work}/tokenizer_config.json", "w"))

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 29, 64)]
    # repeated text, so that ngram speculation finds guesses to verify
    loops = [(p * 4)[:48] for p in prompts[:3]]
    new_tokens = 24

    async def run(extra, items, params, rounds=1):
        config = EngineConfig(model=work, dtype="float32", device=device, log_interval=0,
                              max_running_requests=8, **extra)
        async with AsyncEngine(config) as engine:
            for _ in range(rounds):
                outs = await asyncio.gather(*(engine.generate(p, params) for p in items))
            return outs, engine.stats()

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs, stats = asyncio.run(run({}, prompts, greedy))
    spec_outs, spec_stats = asyncio.run(run(
        {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "rule": "fixed"}},
        loops, greedy))
    overlap_outs, overlap_stats = asyncio.run(
        run({"enable_overlap_schedule": True}, prompts, greedy))
    # scored twice: the second round takes the prompts' pages from the prefix cache, partial
    # tail pages copied
    scoring = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=2)
    scored, scored_stats = asyncio.run(run({}, prompts[1:], scoring, rounds=2))
    # choices sent together behind one 37-token context: one computes it, the others copy its
    # K/V inside the same forward (in-step prefix sharing; in-batch dedup off so nobody waits)
    choices = [prompts[5][:37] + p[:4] for p in prompts[:4]]
    shared, shared_stats = asyncio.run(run({"enable_inbatch_prefix_dedup": False}, choices, scoring))

    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None

    def hf_greedy(items):
        expected = []
        with torch.inference_mode():
            for p in items:
                out = model.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=0)
                expected.append(out[0, len(p):].tolist())
        return expected

    def worst_logprob_error(items, scored_outs):
        worst = 0.0
        for prompt, out in zip(items, scored_outs):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt], device=device)).logits[0].float()
            reference = torch.log_softmax(logits[:-1], dim=-1).cpu()
            for position in range(1, len(prompt)):
                entry = out.prompt_logprobs[position]
                row = reference[position - 1]
                got = [entry.token_logprob] + [value for _, value in entry.top]
                want = [float(row[prompt[position]])] + torch.topk(row, 2).values.tolist()
                worst = max(worst, max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, want)))
        return worst

    print("RESULT " + json.dumps({
        "engine": [o.token_ids for o in outs], "hf": hf_greedy(prompts), "stats": stats,
        "spec": [o.token_ids for o in spec_outs], "spec_hf": hf_greedy(loops),
        "spec_steps": spec_stats["spec_steps"],
        "overlap": [o.token_ids for o in overlap_outs],
        "overlap_planned_ahead": overlap_stats["planned_ahead_steps"],
        "logprob_error": worst_logprob_error(prompts[1:], scored),
        "shared_logprob_error": worst_logprob_error(choices, shared),
        "in_step_shared_tokens": shared_stats["in_step_shared_tokens"],
        "tail_hit_tokens": scored_stats["tail_hit_tokens"],
        "hit_tokens": scored_stats["hit_tokens"],
    }))
"""
)


def run_script(checkpoint: TinyCheckpoint, tmp_path: Path, device: str) -> dict:
    stdout = run_python(_SCRIPT, str(checkpoint.path), str(tmp_path / "model"), device)
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def assert_engine_matches_hf(result: dict) -> None:
    assert result["engine"] == result["hf"]
    assert result["spec"] == result["spec_hf"]
    assert result["spec_steps"] > 0  # guesses were verified (random weights reject most)
    assert result["overlap"] == result["hf"]
    assert result["logprob_error"] < 1e-3
    assert result["tail_hit_tokens"] > 0 and result["hit_tokens"] > 0
    assert result["in_step_shared_tokens"] >= 3 * 36  # each later choice copied the context
    assert result["shared_logprob_error"] < 1e-3


@pytest.mark.slow
def test_engine_script_matches_hf_on_cpu(tiny_llama: TinyCheckpoint, tmp_path: Path) -> None:
    result = run_script(tiny_llama, tmp_path, "cpu")
    assert_engine_matches_hf(result)
    assert result["overlap_planned_ahead"] == 0  # a CPU executor keeps the lock-step path
    assert result["stats"]["pages_total"] == 32768 // 16  # the fixed CPU default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_matches_hf_with_a_gpu_sized_pool(
    tiny_llama: TinyCheckpoint, tmp_path: Path
) -> None:
    result = run_script(tiny_llama, tmp_path, "cuda")
    assert_engine_matches_hf(result)
    # on a GPU the executor fills in deferred inputs: overlap planned decode steps ahead
    assert result["overlap_planned_ahead"] > 0
    # The pool took GPU memory, far past the CPU default (the tiny model's pages are small).
    assert result["stats"]["pages_total"] > 32768 // 16
