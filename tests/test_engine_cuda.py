"""The whole engine on a CUDA GPU (skipped without one): Triton kernels compiled, decode CUDA
graphs on, the KV pool sized from the GPU's memory; greedy tokens equal HF generate's.

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
    new_tokens = 24

    async def engine_outputs():
        config = EngineConfig(model=work, dtype="float32", device=device, log_interval=0,
                              max_running_requests=8)
        async with AsyncEngine(config) as engine:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return [o.token_ids for o in outs], engine.stats()

    tokens, stats = asyncio.run(engine_outputs())
    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    print("RESULT " + json.dumps({"engine": tokens, "hf": expected, "stats": stats}))
    """
)


def run_script(checkpoint: TinyCheckpoint, tmp_path: Path, device: str) -> dict:
    stdout = run_python(_SCRIPT, str(checkpoint.path), str(tmp_path / "model"), device)
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_engine_script_matches_hf_on_cpu(tiny_llama: TinyCheckpoint, tmp_path: Path) -> None:
    result = run_script(tiny_llama, tmp_path, "cpu")
    assert result["engine"] == result["hf"]
    assert result["stats"]["pages_total"] == 32768 // 16  # the fixed CPU default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_matches_hf_with_a_gpu_sized_pool(
    tiny_llama: TinyCheckpoint, tmp_path: Path
) -> None:
    result = run_script(tiny_llama, tmp_path, "cuda")
    assert result["engine"] == result["hf"]
    # The pool took GPU memory, far past the CPU default (the tiny model's pages are small).
    assert result["stats"]["pages_total"] > 32768 // 16
