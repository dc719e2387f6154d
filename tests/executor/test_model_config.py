"""ModelConfig parsing, and the clear refusal of configs the executor does not implement."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from asyncengine.executor.layers.model_config import ModelConfig, RopeScaling, UnsupportedModelError
from asyncengine.executor.layers.rope import build_cos_sin_cache, rope_inv_freq
from tests.conftest import LLAMA32_ROPE_SCALING, TinyCheckpoint

SMOLLM2_LIKE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_parses_a_llama_config() -> None:
    c = ModelConfig.from_hf_dict(SMOLLM2_LIKE)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.q_size, c.kv_size) == (576, 192)
    assert c.rope_theta == 100000.0
    assert c.rope_scaling == RopeScaling()
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert c.max_model_len == 8192


def test_qwen2_has_attention_bias_and_eos_lists() -> None:
    c = ModelConfig.from_hf_dict(
        {
            **SMOLLM2_LIKE,
            "architectures": ["Qwen2ForCausalLM"],
            "eos_token_id": [151643, 151645],
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert c.attention_bias
    assert c.eos_token_ids == (151643, 151645)


def test_rope_parameters_of_transformers_5_and_rope_scaling_of_older_files_agree() -> None:
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ModelConfig.from_hf_dict(
        {**SMOLLM2_LIKE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **llama3}}
    )
    new = ModelConfig.from_hf_dict(
        {
            **SMOLLM2_LIKE,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3},
        }
    )
    assert old == new
    assert new.rope_scaling.rope_type == "llama3" and new.rope_theta == 500000.0
    legacy_type_key = ModelConfig.from_hf_dict(
        {**SMOLLM2_LIKE, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy_type_key.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(
    override: dict[str, Any], field: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf_dict({**SMOLLM2_LIKE, **override})


def test_mistral_slides_every_layer_and_a_window_that_never_takes_effect_is_off() -> None:
    """Mistral-7B-v0.1's form: a window of 4096 below a context of 32768, on every layer (a
    layer_types key, which transformers' Mistral ignores, changes nothing); a window no position
    reaches past (v0.2's 32768 of 32768) runs as plain attention."""
    mistral = {
        **SMOLLM2_LIKE,
        "architectures": ["MistralForCausalLM"],
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    c = ModelConfig.from_hf_dict(mistral)
    assert [c.layer_window(i) for i in range(30)] == [4096] * 30
    alternating = ["full_attention", "sliding_attention"] * 15
    assert ModelConfig.from_hf_dict({**mistral, "layer_types": alternating}) == c
    for window in (32768, None):
        off = ModelConfig.from_hf_dict({**mistral, "sliding_window": window})
        assert (off.sliding_window, off.sliding_layers) == (0, ())


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_windows_the_layers_from_max_window_layers_with_use_sliding_window(
    architecture: str,
) -> None:
    """As transformers builds layer_types where a file has none: sliding from
    max_window_layers on, and only with use_sliding_window; a file's layer_types win."""
    qwen = {
        **SMOLLM2_LIKE,
        "architectures": [architecture],
        "num_hidden_layers": 4,
        "sliding_window": 1024,
        "max_window_layers": 2,
    }
    assert ModelConfig.from_hf_dict(qwen).sliding_layers == ()
    c = ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True})
    assert [c.layer_window(i) for i in range(4)] == [0, 0, 1024, 1024]
    types = ["sliding_attention", "full_attention"] * 2
    c = ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True, "layer_types": types})
    assert [c.layer_window(i) for i in range(4)] == [1024, 0, 1024, 0]


def test_qwen3_has_qk_norm_and_no_bias() -> None:
    c = ModelConfig.from_hf_dict(
        {
            **SMOLLM2_LIKE,
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": 128,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert c.qk_norm and not c.attention_bias and c.head_dim == 128
    assert (c.norm_weight_offset, c.activation, c.embedding_multiplier) == (0.0, "silu", None)


@pytest.mark.parametrize(
    "act", [{"hidden_act": "gelu_pytorch_tanh"}, {"hidden_act": "gelu", "hidden_activation": None}]
)
def test_gemma_norm_offset_geglu_and_embedding_scale(act: dict[str, Any]) -> None:
    d = {k: v for k, v in SMOLLM2_LIKE.items() if k != "tie_word_embeddings"}
    c = ModelConfig.from_hf_dict({**d, "architectures": ["GemmaForCausalLM"], **act})
    assert c.tie_word_embeddings and not c.qk_norm
    assert (c.norm_weight_offset, c.activation) == (1.0, "gelu_tanh")
    assert c.embedding_multiplier == pytest.approx(576**0.5)


@pytest.mark.parametrize("arch", ["PhiForCausalLM", "Gemma3ForConditionalGeneration"])
def test_other_families_keep_their_clear_refusal(arch: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"unsupported architectures=.*{arch}"):
        ModelConfig.from_hf_dict({**SMOLLM2_LIKE, "architectures": [arch]})


def test_multimodal_gemma3_is_refused_pointing_to_the_text_model() -> None:
    with pytest.raises(UnsupportedModelError, match="text-only Gemma3ForCausalLM is"):
        ModelConfig.from_hf_dict(
            {**SMOLLM2_LIKE, "architectures": ["Gemma3ForConditionalGeneration"]}
        )


GEMMA2_FILE: dict[str, Any] = {  # google/gemma-2-2b's config.json, shortened to 5 layers
    **SMOLLM2_LIKE,
    "architectures": ["Gemma2ForCausalLM"],
    "hidden_size": 2304,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "rope_theta": 10000.0,
}


def test_gemma2_sandwich_norms_softcaps_and_alternating_windows() -> None:
    c = ModelConfig.from_hf_dict(GEMMA2_FILE)
    assert c.sandwich_norms and not c.qk_norm and c.norm_weight_offset == 1.0
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.attention_scale == pytest.approx(256**-0.5)
    assert c.activation == "gelu_tanh" and c.embedding_multiplier == pytest.approx(48.0)
    # no layer_types in older files: HF's default, sliding on even layers
    assert c.sliding_layers == (True, False, True, False, True)
    assert [c.layer_window(i) for i in range(5)] == [4096, 0, 4096, 0, 4096]
    assert c.sliding_rope_theta is None


def test_gemma3_per_layer_rope_from_an_older_file_and_from_transformers_5() -> None:
    older = {
        **GEMMA2_FILE,
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 7,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    c = ModelConfig.from_hf_dict(older)
    assert c.qk_norm and c.sandwich_norms
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (0.0, 0.0)
    assert c.sliding_layers == (True,) * 5 + (False, True)
    assert (c.rope_theta, c.rope_scaling) == (1e6, RopeScaling("linear", 8.0))
    assert (c.sliding_rope_theta, c.sliding_rope_scaling) == (1e4, RopeScaling())
    newer = {k: v for k, v in older.items() if not k.startswith("rope")}
    newer["layer_types"] = ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    newer["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    c = ModelConfig.from_hf_dict(newer)
    assert c.sliding_layers == (False, True) * 3 + (False,)
    assert (c.rope_theta, c.rope_scaling) == (1e6, RopeScaling("linear", 8.0))
    assert (c.sliding_rope_theta, c.sliding_rope_scaling) == (1e4, RopeScaling())
    # its max_position_embeddings is its context, the linear scaling already counted (vLLM's)
    assert c.max_model_len == c.max_position_embeddings


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_linear_scaling_stretches_the_context_by_its_factor(key: str) -> None:
    """As vLLM and transformers count it: positions up to max_position_embeddings x factor."""
    c = ModelConfig.from_hf_dict(
        {
            **SMOLLM2_LIKE,
            "max_position_embeddings": 4096,
            "rope_scaling": {key: "linear", "factor": 4.0},
        }
    )
    assert c.max_model_len == 16384
    assert build_cos_sin_cache(c).shape[0] == 16384


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["chunked_attention"] * 5}, "layer_types="),
        ({"layer_types": ["full_attention"] * 4}, "5 entries"),
    ],
)
def test_gemma_features_we_do_not_run_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({**GEMMA2_FILE, **change})


def test_a_window_on_a_family_without_windows_is_refused() -> None:
    """transformers' Llama ignores sliding_window: a checkpoint that carries one expects
    attention the family does not run, so it is refused naming the families that do."""
    with pytest.raises(UnsupportedModelError, match="sliding_window=128 for LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**SMOLLM2_LIKE, "sliding_window": 128})


def test_tiny_checkpoints_parse(tiny_checkpoints: dict[str, TinyCheckpoint]) -> None:
    configs = {n: ModelConfig.from_hf_dict(ck.hf_config) for n, ck in tiny_checkpoints.items()}
    assert configs["qwen2_bias"].attention_bias
    assert configs["llama_tied"].tie_word_embeddings
    assert not configs["llama_gqa"].tie_word_embeddings
    assert configs["llama3_rope"].rope_scaling.rope_type == "llama3"
    assert configs["qwen3_qk_norm"].qk_norm and configs["qwen3_qk_norm"].head_dim == 24
    assert configs["gemma"].activation == "gelu_tanh" and configs["gemma"].tie_word_embeddings
    assert configs["gemma2"].sliding_layers == (True, False, True, False)
    assert configs["gemma2"].attn_logit_softcap == 2.0
    assert configs["gemma3"].qk_norm and configs["gemma3"].sliding_rope_theta == 100.0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        # Qwen2.5's long-context form (the old "type" key), then every YaRN parameter given
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
        {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5},
    ],
)
def test_inv_freq_and_cos_sin_match_hf(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_dict = {
        **SMOLLM2_LIKE,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rope_scaling": rope,
    }
    ours = ModelConfig.from_hf_dict(hf_dict)
    hf_config = LlamaConfig(**{k: v for k, v in hf_dict.items() if k != "architectures"})
    hf_rope = LlamaRotaryEmbedding(hf_config)
    torch.testing.assert_close(rope_inv_freq(ours), hf_rope.inv_freq, rtol=0, atol=0)

    positions = torch.arange(200)[None]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)
    cache = build_cos_sin_cache(ours)
    half = ours.head_dim // 2
    torch.testing.assert_close(cache[:200, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(cache[:200, half:], sin[0, :, :half], rtol=0, atol=1e-6)


def test_dynamic_ntk_stretches_positions_past_the_trained_length() -> None:
    c = ModelConfig.from_hf_dict(
        {
            **SMOLLM2_LIKE,
            "max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        }
    )
    assert c.max_model_len == 128
    cache = build_cos_sin_cache(c)
    assert cache.shape == (128, c.head_dim)
    plain = torch.arange(128, dtype=torch.float32)[:, None] * rope_inv_freq(c)[None, :]
    half = c.head_dim // 2
    torch.testing.assert_close(cache[:64, :half], plain[:64].cos())
    assert not torch.allclose(cache[100, :half], plain[100].cos())


def test_yarn_stretches_the_original_length_by_its_factor() -> None:
    """As Qwen2.5's YaRN config reads: 32k trained, 4x by YaRN, a 128k context."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    c = ModelConfig.from_hf_dict(
        {**SMOLLM2_LIKE, "max_position_embeddings": 32768, "rope_scaling": yarn}
    )
    assert c.rope_scaling.rope_type == "yarn" and c.max_model_len == 131072
    assert c.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize(
    ("hf_dict", "positions"),
    [
        (  # Llama 3.2's RoPE: positions past its original 8192
            {
                "max_position_embeddings": 131072,
                "rope_theta": 500000.0,
                "rope_scaling": LLAMA32_ROPE_SCALING,
            },
            (8000, 10000),
        ),
        (  # Qwen2.5's with YaRN (head dim 128): positions past its original 32768
            {
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 256,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 32768,
                "rope_theta": 1000000.0,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            (32000, 34000),
        ),
    ],
    ids=["llama3.2", "qwen2.5-yarn"],
)
def test_real_long_context_rope_matches_hf_past_the_original_length(
    hf_dict: dict[str, Any], positions: tuple[int, int]
) -> None:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    d = {**SMOLLM2_LIKE, **hf_dict}
    ours = ModelConfig.from_hf_dict(d)
    model_type = "qwen2" if d["architectures"] == ["Qwen2ForCausalLM"] else "llama"
    hf_rope = LlamaRotaryEmbedding(AutoConfig.for_model(model_type, **d))
    lo, hi = positions
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(lo, hi)[None])
    cache = build_cos_sin_cache(ours, hi)
    half = ours.head_dim // 2
    torch.testing.assert_close(cache[lo:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(cache[lo:, half:], sin[0, :, :half], rtol=0, atol=1e-6)
