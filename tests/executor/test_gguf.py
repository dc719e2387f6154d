"""GGUF files: a tiny one written the llama.cpp way round-trips exactly; the embedded default model
matches transformers' own GGUF loader, and is converted into the cache once."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncengine.executor.loader import (
    CACHE_ENV,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelFilesError,
    load_eos_token_ids,
    load_hf_config,
    load_weights,
    read_gguf,
    resolve_model,
    tokenizer_dir,
)
from asyncengine.executor.loader import default_model as default_model_module
from asyncengine.text.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


TINY_TOKENS = SPECIAL_TOKENS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_BLOCK_NAMES[module]}.{suffix}"


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (written from its description)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A GQA llama with q/k/v biases, written as GGUF the way llama.cpp converts it."""
    config = LlamaConfig(
        vocab_size=len(TINY_TOKENS),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)

    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(48)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(8)
    writer.add_vocab_size(len(TINY_TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types(
        [3] * len(SPECIAL_TOKENS) + [1] * (len(TINY_TOKENS) - len(SPECIAL_TOKENS))
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().copy()
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, 4)
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, 2)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def test_tiny_gguf_weights_round_trip_exactly(tiny) -> None:
    path, model = tiny
    checkpoint = read_gguf(path, torch.float32)
    expected = model.state_dict()
    assert checkpoint.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.weights[name], tensor), name


def test_tiny_gguf_config_matches_the_model(tiny) -> None:
    path, model = tiny
    config = read_gguf(path, torch.bfloat16).config
    hf = model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"


def test_tiny_gguf_resolves_once_into_a_directory_transformers_loads(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = tiny
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    directory = resolve_model(str(path), torch.float32)
    assert directory.parent == tmp_path / "cache"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [directory.name]  # no temp dirs left
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(path), torch.float32) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    assert resolve_model(str(path), torch.bfloat16) != directory

    reloaded = LlamaForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([[5, 100, 260, 7, 42, 200]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)

    tokenizer = Tokenizer(directory)
    assert tokenizer.encode(" the<|im_end|>") == [TINY_TOKENS.index("Ġthe"), 2]
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.decode(tokenizer.encode("the 42 héllo")) == "the 42 héllo"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_gguf_template_that_does_not_compile_is_reported_against_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error names the GGUF and its metadata key, not the cache's tokenizer_config.json the
    template would be copied into, and no cache entry is left behind."""
    path = tmp_path / "broken-template.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ModelFilesError) as raised:
        tokenizer_dir(path)
    assert str(raised.value).startswith(
        f"{path} (tokenizer.chat_template): the chat template does not compile: line 1"
    )
    assert not list((tmp_path / "cache").glob("*tokenizer*"))


# -- the embedded default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """The default model converted into a fresh cache: (directory, conversions run)."""
    cache = tmp_path_factory.mktemp("asyncengine_cache")
    conversions = 0
    convert = default_model_module.convert_gguf_to_hf_dir

    def counted(*args: object) -> None:
        nonlocal conversions
        conversions += 1
        convert(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(cache))
        patch.setattr(default_model_module, "convert_gguf_to_hf_dir", counted)
        directory = resolve_model(DEFAULT_MODEL, torch.float32)
    yield directory, conversions
    shutil.rmtree(cache)  # the float32 checkpoint, ~0.5 GB: not kept until the whole run ends


@pytest.fixture(scope="module")
def hf_gguf_checkpoint(default_model) -> dict:
    """transformers' own reading of the same GGUF file (config and tensors)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The skeleton only tells transformers which HF names exist (it reads its own config from
    # the file for everything else, un-permuting included), so ours can shape it.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**load_hf_config(default_model[0])))
    path = KNOWN_MODELS[DEFAULT_MODEL].gguf_path()
    return load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )


@pytest.mark.slow
def test_default_model_weights_equal_transformers_gguf_loader(
    default_model, hf_gguf_checkpoint
) -> None:
    directory, _ = default_model
    ours = load_weights(directory, torch.float32)
    theirs = hf_gguf_checkpoint["tensors"]
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.slow
def test_default_model_config_matches_transformers_gguf_loader(
    default_model, hf_gguf_checkpoint
) -> None:
    directory, _ = default_model
    ours = load_hf_config(directory)
    theirs = hf_gguf_checkpoint["config"]
    for key in (
        "num_hidden_layers",
        "max_position_embeddings",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rope_theta",
        "vocab_size",
        "head_dim",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == theirs[key], key
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["vocab_size"]) == (576, 30, 49152)
    assert load_eos_token_ids(directory) == [2]
    template = json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]
    assert template.startswith("{% for message in messages %}") and "<|im_start|>" in template


@pytest.mark.slow
def test_converted_config_parses_as_a_model_config(default_model) -> None:
    from asyncengine.executor.layers.model_config import ModelConfig

    config = ModelConfig.from_hf_dict(load_hf_config(default_model[0]))
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0


@pytest.mark.slow
def test_default_model_is_converted_once_then_reused(default_model) -> None:
    directory, conversions = default_model
    assert conversions == 1
    cache = directory.parent
    assert directory.name == "smollm2-135m-float32"
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    written = (directory / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args: object) -> None:
        raise AssertionError("the GGUF file was converted again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(cache))
        patch.setattr(default_model_module, "convert_gguf_to_hf_dir", no_second_conversion)
        assert resolve_model(DEFAULT_MODEL, torch.float32) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in cache.iterdir()] == [directory.name]


def test_yarn_parameters_come_from_the_gguf_metadata_as_the_converter_writes_them() -> None:
    """A Qwen2.5 YaRN checkpoint through llama.cpp's converter: rope.scaling.type / factor /
    original_context_length and, where the config gives them, yarn_beta_* and yarn_attn_factor
    (float32 in the file): the same RoPE as the HF config's."""
    from asyncengine.executor.layers.model_config import ModelConfig
    from asyncengine.executor.layers.rope import build_cos_sin_cache
    from asyncengine.executor.loader.gguf_loader import hf_config

    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768}
    extra = {"beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3}
    metadata: dict[str, object] = {
        "general.architecture": "qwen2",
        "qwen2.embedding_length": 256,
        "qwen2.feed_forward_length": 512,
        "qwen2.block_count": 2,
        "qwen2.attention.head_count": 2,
        "qwen2.attention.head_count_kv": 1,
        "qwen2.context_length": 32768,
        "qwen2.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "qwen2.rope.freq_base": 1000000.0,
        "qwen2.vocab_size": 1000,
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    for key, value in extra.items():
        gguf_key = "attn_factor" if key == "attention_factor" else key
        metadata[f"qwen2.rope.scaling.yarn_{gguf_key}"] = float(np.float32(value))
    got = ModelConfig.from_hf_dict(hf_config(metadata, set(), torch.float32))
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", **yarn, **extra},
    }
    want = ModelConfig.from_hf_dict(hf)
    assert got.rope_scaling == want.rope_scaling and got.rope_scaling.attention_factor == 1.3
    assert got.max_model_len == want.max_model_len == 131072
    assert torch.equal(build_cos_sin_cache(got, 40000), build_cos_sin_cache(want, 40000))


def _gemma3_metadata(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """A Gemma 3 GGUF's keys as llama.cpp's converter writes them (no sliding-layer pattern, no
    attention scale: llama.cpp knows those)."""
    return {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": hidden,
        "gemma3.feed_forward_length": 4 * hidden,
        "gemma3.block_count": layers,
        "gemma3.attention.head_count": heads,
        "gemma3.attention.head_count_kv": kv_heads,
        "gemma3.attention.key_length": head_dim,
        "gemma3.attention.value_length": head_dim,
        "gemma3.attention.sliding_window": 1024,
        "gemma3.context_length": 131072,
        "gemma3.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        "gemma3.rope.freq_base": 1000000.0,
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
        "gemma3.vocab_size": 262208,
    }


@pytest.mark.parametrize(
    ("shape", "query_pre_attn_scalar"),
    [((34, 2560, 8, 4, 256), 256), ((62, 5376, 32, 16, 128), 168)],  # Gemma 3 4B and 27B
)
def test_gemma3_config_gets_what_the_file_leaves_out_as_llama_cpp_sets_it(
    shape: tuple[int, int, int, int, int], query_pre_attn_scalar: int
) -> None:
    """Every sixth layer full, the sliding layers' RoPE base 10000, queries scaled by head_dim
    (a 27B's by hidden / heads): the same model as the HF config of that checkpoint."""
    from asyncengine.executor.layers.model_config import ModelConfig
    from asyncengine.executor.loader.gguf_loader import hf_config

    layers, hidden, heads, kv_heads, head_dim = shape
    got = ModelConfig.from_hf_dict(hf_config(_gemma3_metadata(*shape), set(), torch.bfloat16))
    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262208,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    want = ModelConfig.from_hf_dict(hf)
    assert replace(got, eos_token_ids=(), bos_token_id=None) == want
    assert got.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(layers))


def test_a_gguf_architecture_not_served_is_refused_naming_those_that_are() -> None:
    from asyncengine.executor.loader.gguf_loader import hf_config

    metadata = {**_gemma3_metadata(26, 1152, 4, 1, 256), "general.architecture": "gemma"}
    served = r"\(supported: llama, qwen2, qwen3, gemma2, gemma3\)"
    with pytest.raises(
        ModelFilesError, match=rf"GGUF architecture 'gemma' is not supported {served}"
    ):
        hf_config(metadata, set(), torch.float32)


def test_unused_tokens_of_a_padded_vocabulary_decode_to_nothing() -> None:
    """A vocabulary padded to the embedding's rows ("[PAD3]", GGUF token type 5) prints as
    nothing, as in llama.cpp; the other tokens decode as before."""
    from asyncengine.executor.loader.gguf_tokenizer import byte_level_bpe_tokenizer

    metadata = {
        "tokenizer.ggml.tokens": ["a", "b", "ab", "[PAD3]"],
        "tokenizer.ggml.token_type": [1, 1, 1, 5],
        "tokenizer.ggml.merges": ["a b"],
    }
    tokenizer = byte_level_bpe_tokenizer(metadata)
    assert tokenizer.encode("ab").ids == [2]
    assert tokenizer.decode([2, 3, 0], skip_special_tokens=True) == "aba"
