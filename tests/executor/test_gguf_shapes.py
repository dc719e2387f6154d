"""Shapes beyond the toy, through a GGUF written the way llama.cpp's converter writes it: Llama 3
RoPE scaling (its rope_freqs tensor), Qwen2 (its own architecture key, q/k/v biases, rows not
permuted), Qwen3 (q/k norms), Gemma 2 (norms stored as 1 + weight, sandwich norms, soft-caps,
alternate sliding layers), Gemma 3 (q/k norms, five sliding layers to a full one, the sliding
layers' own RoPE base, linear RoPE scaling on the full ones), GQA 4:1, 6:1 and 8:1, head dim
128, an MLP of 8960 (Qwen2.5-1.5B's), tied and untied embeddings, a 128k vocabulary (the
converter's [PADn] tokens). The whole engine on the file against HF transformers (float32) on
the same weights: greedy tokens equal, the logprob of every generated token close, with the
file's tensors as stored (F32) and expanded from F16 (``quantization = "none"``); kept as Q8_0
blocks, close to HF on the weights those blocks hold."""

from __future__ import annotations

import asyncio
import math
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.layers.rope import rope_inv_freq
from asyncengine.executor.loader import CACHE_ENV, load_hf_config, read_gguf, resolve_model
from tests.executor.test_gguf import (
    CHATML,
    GGUF_BLOCK_NAMES,
    GGUF_NAMES,
    MERGES,
    SPECIAL_TOKENS,
    TINY_TOKENS,
    _llama_cpp_permute,
)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (HF architecture, config overrides)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_rope_gqa8_untied": (
        "llama",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "tie_word_embeddings": False,
            "rope_theta": 500.0,
            "rope_scaling": LLAMA3,
        },
    ),
    "qwen2_bias_gqa4_tied": (
        "qwen2",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    # Qwen2.5-1.5B's attention and MLP: head dim 128, 12 query / 2 KV heads (6:1), MLP 8960
    # (a gate_up row of 17,920 values); the init scaled to keep the tiny shapes' logit scale
    "qwen2_hd128_gqa6_mlp8960_tied": (
        "qwen2",
        {
            "hidden_size": 1536,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
            "tie_word_embeddings": True,
            "initializer_range": 0.25 * (128 / 1536) ** 0.5,
        },
    ),
    "qwen3_qk_norm_gqa2_untied": (
        "qwen3",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 48,  # not hidden / heads: read from the file's key_length
            "tie_word_embeddings": False,
        },
    ),
    # the attention scale and the window that a GGUF can hold: query_pre_attn_scalar = head_dim
    "gemma2_softcaps_sliding": (
        "gemma2",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 15.0,
        },
    ),
    "gemma3_sliding_local_rope_linear": (
        "gemma3",
        {
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ),
    "llama_vocab128k_gqa4_tied": (
        "llama",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "vocab_size": 128256,
            "hidden_size": 64,
        },
    ),
}


# the int8 blocks' error grows with the products' width faster than a logit does: at hidden 1536
# and an MLP of 8960, 0.30 at most over the items (0.25 at hidden 128)
Q8_0_LOGPROB_TOLERANCE = {"qwen2_hd128_gqa6_mlp8960_tied": 0.45}


def converter_rope_factors(theta: float, head_dim: int, p: dict[str, Any]) -> list[float]:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3 (its loop)."""
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return factors


# HF name -> GGUF name where the converter's differ from llama's (Gemma 2/3's sandwich norms)
SANDWICH_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
QK_NORM_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def converter_name(hf: str, kind: str) -> str:
    """The GGUF name llama.cpp's converter gives an HF tensor of this architecture."""
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = {**GGUF_BLOCK_NAMES, **QK_NORM_NAMES}
    if kind.startswith("gemma"):
        names.update(SANDWICH_NAMES)
    return f"blk.{layer}.{names[module]}.{suffix}"


def make_hf(name: str, directory: Path) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    kind, overrides = SHAPES[name]
    settings: dict[str, Any] = {
        "vocab_size": len(TINY_TOKENS),
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.25,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **overrides,
    }
    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
    }
    if kind == "gemma3":
        del settings["rope_theta"]  # in its rope_parameters, per layer type
    config = classes[kind](**settings)
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases and norms, so that a dropped one shows
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model


# ggml's kvalues_iq4nl
IQ4_NL_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def iq4_nl_blocks(array: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of a float32 [rows, cols] array (gguf-py has no IQ4_NL quantizer): per block of
    32 an fp16 d = max|x| / 127, each value the nearest level times d, as ggml packs the nibbles
    (value j in byte j % 16, the low half for j < 16)."""
    blocks = array.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    scale = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    nearest = np.abs((blocks / scale)[..., None] - IQ4_NL_LEVELS).argmin(-1).astype(np.uint8)
    nibbles = nearest[:, :16] | (nearest[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), nibbles], axis=1).reshape(
        array.shape[0], -1
    )


def write_gguf(
    name: str, model: Any, path: Path, stored: gguf.GGMLQuantizationType | None = None
) -> None:
    """As convert_hf_to_gguf.py writes it (``stored``: the 2-D projections' type: F16, Q8_0, Q5_0,
    Q5_1 or IQ4_NL (as llama-quantize would); None: float32 as the model holds them)."""
    kind, _ = SHAPES[name]
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if kind != "gemma2":  # its converter writes no RoPE base (HF's default, 10000)
        writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "head_dim", None):  # the converter writes the config's own head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if kind in ("llama", "qwen2"):
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(c.vocab_size)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if kind.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if kind == "gemma3":
        writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    pads = [f"[PAD{i}]" for i in range(len(TINY_TOKENS), c.vocab_size)]
    writer.add_token_list(TINY_TOKENS + pads)
    writer.add_token_types(
        [3] * len(SPECIAL_TOKENS)
        + [1] * (len(TINY_TOKENS) - len(SPECIAL_TOKENS))
        + [int(gguf.TokenType.UNUSED)] * len(pads)
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    if c.rope_parameters.get("rope_type") == "llama3":
        factors = converter_rope_factors(c.rope_parameters["rope_theta"], head_dim, LLAMA3)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # the converter writes no output.weight for a tied model
        array = tensor.numpy().copy()
        if kind == "llama" and ".q_proj.weight" in hf_name:
            array = _llama_cpp_permute(array, c.num_attention_heads)
        elif kind == "llama" and ".k_proj.weight" in hf_name:
            array = _llama_cpp_permute(array, c.num_key_value_heads)
        if kind.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1  # HF's Gemma norms scale by 1 + weight: the converter adds the 1
        gguf_name = converter_name(hf_name, kind)
        blocky = (
            gguf.GGMLQuantizationType.Q8_0,
            gguf.GGMLQuantizationType.Q5_0,
            gguf.GGMLQuantizationType.Q5_1,
        )
        if stored in blocky and array.ndim == 2 and "_proj" in hf_name:
            blocks = gguf.quants.quantize(array, stored)
            writer.add_tensor(gguf_name, blocks, raw_dtype=stored)
        elif stored == gguf.GGMLQuantizationType.IQ4_NL and array.ndim == 2 and "_proj" in hf_name:
            writer.add_tensor(gguf_name, iq4_nl_blocks(array), raw_dtype=stored)
        elif stored == gguf.GGMLQuantizationType.F16 and array.ndim == 2 and "_proj" in hf_name:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = make_hf(name, folder / "hf")
    write_gguf(name, model, folder / f"{name}.gguf")
    write_gguf(name, model, folder / f"{name}-f16.gguf", gguf.GGMLQuantizationType.F16)
    write_gguf(name, model, folder / f"{name}-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    yield name, folder, model
    shutil.rmtree(folder)  # ~0.8 GB for Qwen2.5-1.5B's MLP: not kept until the whole run ends


def test_config_read_from_the_gguf_equals_the_hf_directorys(shape: Any) -> None:
    name, folder, _ = shape
    want = ModelConfig.from_hf_dict(load_hf_config(folder / "hf"))
    checkpoint = read_gguf(folder / f"{name}.gguf", torch.float32)
    got = ModelConfig.from_hf_dict(checkpoint.config)
    assert got == want
    assert got.architecture == want.architecture
    assert got.tie_word_embeddings == want.tie_word_embeddings
    assert got.attention_bias == want.attention_bias
    assert (got.num_heads, got.num_kv_heads, got.head_dim, got.vocab_size) == (
        want.num_heads,
        want.num_kv_heads,
        want.head_dim,
        want.vocab_size,
    )
    assert got.rope_scaling.rope_type == want.rope_scaling.rope_type
    torch.testing.assert_close(rope_inv_freq(got), rope_inv_freq(want), rtol=1e-6, atol=0)
    assert "rope_freqs.weight" not in checkpoint.weights


def _items(vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(3)
    # prompts past original_max_position_embeddings (64), where Llama 3's scaling changes RoPE
    return [([rng.randrange(3, vocab) for _ in range(n)], 10) for n in (5, 30, 90)]


async def _engine(
    model: Path, items: list[tuple[list[int], int]], quantization: str = "auto"
) -> list[Any]:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        page_size=4,
        kv_cache_tokens=1024,
        log_interval=0,
        quantization=quantization,
    )
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    async with AsyncEngine(config) as engine:
        return [await engine.generate(prompt, params) for prompt, _ in items]


def _hf_reference(
    model: Any, prompt: list[int], out: list[int], n: int
) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        greedy = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        logprobs = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float(), dim=-1)
    return greedy, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.mark.slow
def test_engine_on_the_gguf_matches_hf_greedy_and_logprobs(shape: Any) -> None:
    name, folder, model = shape
    items = _items(len(TINY_TOKENS))
    for out, (prompt, n) in zip(
        asyncio.run(_engine(folder / f"{name}.gguf", items)), items, strict=True
    ):
        want_tokens, want_logprobs = _hf_reference(model, prompt, out.token_ids, n)
        assert out.token_ids == want_tokens
        got = [lp.token_logprob for lp in out.logprobs or []]
        assert got == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.slow
def test_f16_gguf_expanded_loads_in_transformers_and_the_engine_follows_it(
    shape: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quantization = "none"``: the F16 file expanded into an HF directory holds the model's
    weights rounded to float16 (norms given back their HF form), transformers loads it, and the
    engine on the file gives transformers' greedy tokens and logprobs on that directory."""
    from transformers import AutoModelForCausalLM

    name, folder, model = shape
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = folder / f"{name}-f16.gguf"
    expanded = AutoModelForCausalLM.from_pretrained(
        resolve_model(str(path), torch.float32), dtype=torch.float32
    ).eval()
    assert type(expanded) is type(model)
    original = model.state_dict()
    for param_name, tensor in expanded.state_dict().items():
        want = original[param_name]
        if "_proj" in param_name and want.dim() == 2:  # as write_gguf stores them
            want = want.half().float()
        torch.testing.assert_close(tensor, want, rtol=0, atol=2e-7, msg=param_name)
    items = _items(len(TINY_TOKENS))
    for out, (prompt, n) in zip(
        asyncio.run(_engine(path, items, quantization="none")), items, strict=True
    ):
        want_tokens, want_logprobs = _hf_reference(expanded, prompt, out.token_ids, n)
        assert out.token_ids == want_tokens
        got = [lp.token_logprob for lp in out.logprobs or []]
        assert got == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.slow
def test_q8_0_blocks_follow_hf_on_the_weights_they_hold(shape: Any) -> None:
    """Kept as Q8_0 (the CPU kernels): against HF on the dequantized weights, the logprobs of
    the engine's tokens agree within the rounding of the activations the kernels quantize."""
    from transformers import AutoModelForCausalLM

    name, folder, _ = shape
    path = folder / f"{name}-q8_0.gguf"
    reference = AutoModelForCausalLM.from_pretrained(folder / "hf", dtype=torch.float32).eval()
    weights = read_gguf(path, torch.float32).weights  # every tensor dequantized, HF names
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            param.copy_(weights[param_name])
    items = _items(len(TINY_TOKENS))
    for out, (prompt, n) in zip(asyncio.run(_engine(path, items)), items, strict=True):
        _, want_logprobs = _hf_reference(reference, prompt, out.token_ids, n)
        got = [lp.token_logprob for lp in out.logprobs or []]
        # each product quantizes its input to int8 blocks (~1%): 0.12-0.25 at most here, where a
        # wrong bias, permutation or RoPE is off by more than 1
        assert got == pytest.approx(want_logprobs, abs=Q8_0_LOGPROB_TOLERANCE.get(name, 0.3))
