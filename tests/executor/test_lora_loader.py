"""PEFT adapters as the loader reads them: PEFT's scaling (alpha / r, rsLoRA's alpha / sqrt(r),
alpha_pattern, PEFT's default alpha), fused q/k/v and gate/up blocks, and a clear refusal of
what does not fit the base model, which leaves the registry as it was, and of the PEFT options
under which PEFT's output is not the plain LoRA update's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.lora.peft_adapter import LoraLoadError, load_peft_adapter
from asyncengine.executor.lora.registry import LoraRegistry, UnknownLoraError
from tests.conftest import TinyCheckpoint
from tests.executor.lora_support import fresh_hf_model

PREFIX = "base_model.model.model.layers"


def write(path: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    """An adapter directory; its ``r`` and ``rank_pattern`` say the tensors' ranks (as PEFT
    writes them) unless ``config`` gives its own."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = {
        name.removesuffix(".lora_A.weight"): int(t.shape[0])
        for name, t in tensors.items()
        if name.endswith(".lora_A.weight")
    }
    r = max(ranks.values(), default=4)
    pattern = {module.removeprefix("base_model.model."): k for module, k in ranks.items() if k != r}
    settings = {"peft_type": "LORA", "r": r, "rank_pattern": pattern, "lora_alpha": 8, **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def pair(module: str, rank: int, out: int, inp: int, layer: int = 0) -> dict[str, torch.Tensor]:
    name = f"{PREFIX}.{layer}.{module}"
    return {
        f"{name}.lora_A.weight": torch.randn(rank, inp),
        f"{name}.lora_B.weight": torch.randn(out, rank),
    }


@pytest.fixture
def config(tiny_llama: TinyCheckpoint) -> ModelConfig:
    return ModelConfig.from_hf_dict(tiny_llama.hf_config)


def test_scaling_and_fused_blocks(config: ModelConfig, tmp_path: Path) -> None:
    h, kv = config.hidden_size, config.kv_size
    tensors = {
        **pair("self_attn.q_proj", 4, config.q_size, h),
        **pair("self_attn.v_proj", 2, kv, h),
    }
    path = write(tmp_path / "a", tensors, use_rslora=True, alpha_pattern={"v_proj": 2})
    adapter = load_peft_adapter("a", path, config, 64)
    qkv = adapter.layers[0]["qkv"]
    assert qkv.rank == 6 and adapter.rank == 4 and set(adapter.layers[0]) == {"qkv"}
    assert qkv.slices == (
        (0, config.q_size, 0, 4),
        (config.q_size + kv, config.q_size + 2 * kv, 4, 6),
    )
    q_b = tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    v_b = tensors[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"]
    assert torch.allclose(qkv.b[: config.q_size, :4], q_b * 8 / math.sqrt(4))
    assert torch.allclose(qkv.b[config.q_size + kv :, 4:], v_b * 2 / math.sqrt(2))
    assert not qkv.b[config.q_size : config.q_size + kv].any()  # k is not targeted
    assert all(not layer for layer in adapter.layers[1:])


def test_an_adapter_config_without_lora_alpha_scales_by_peft_default(
    config: ModelConfig, tmp_path: Path
) -> None:
    tensors = pair("self_attn.q_proj", 4, config.q_size, config.hidden_size)
    path = write(tmp_path / "a", tensors)
    settings = json.loads((path / "adapter_config.json").read_text())
    del settings["lora_alpha"]  # PEFT's LoraConfig then takes lora_alpha = 8, whatever r is
    (path / "adapter_config.json").write_text(json.dumps(settings))
    qkv = load_peft_adapter("a", path, config, 64).layers[0]["qkv"]
    q_b = tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(qkv.b[: config.q_size, :4], q_b * 8 / 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens is set: activated LoRA"),
        ({"arrow_config": {"top_k": 2}}, "arrow_config is set"),
        ({"use_bdlora": {"nblocks": 2}}, "use_bdlora is set"),
        ({"velora_config": {"rank": 2}}, "velora_config is set"),
        ({"monteclora_config": {"n": 2}}, "monteclora_config is set"),
        ({"kasa_config": {"beta": 1.0}}, "kasa_config is set"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication is set"),
        ({"lora_bias": True}, "lora_bias is set"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices is set"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa' changes the base weights"),
        ({"init_lora_weights": "pissa_niter_4"}, "'pissa_niter_4' changes the base weights"),
        ({"init_lora_weights": "olora"}, "'olora' changes the base weights"),
        ({"init_lora_weights": "corda"}, "'corda' changes the base weights"),
        ({"init_lora_weights": "loftq"}, "'loftq' changes the base weights"),
    ],
)
def test_peft_options_that_change_its_output_are_refused(
    config: ModelConfig, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    """Read as a plain LoRA, each would be served with other outputs than PEFT's."""
    tensors = pair("self_attn.q_proj", 2, config.q_size, config.hidden_size)
    with pytest.raises(LoraLoadError, match=message):
        load_peft_adapter("a", write(tmp_path / "a", tensors, **settings), config, 64)


@pytest.mark.parametrize(
    "options",
    [{"alora_invocation_tokens": [310, 311]}, {"init_lora_weights": "pissa"}],
    ids=["alora", "pissa"],
)
def test_adapters_peft_writes_with_such_options_are_refused(
    tiny_llama: TinyCheckpoint, config: ModelConfig, tmp_path: Path, options: dict[str, Any]
) -> None:
    """As PEFT saves them: its output under these adapters differs from ``W x + scaling B A x``
    (aLoRA's before its invocation tokens; PiSSA's base loses its principal components)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **options)
    peft_model = get_peft_model(fresh_hf_model(tiny_llama.path), lora)
    peft_model.save_pretrained(tmp_path / "a")
    name = next(iter(options))
    with pytest.raises(LoraLoadError, match=name):
        load_peft_adapter("a", tmp_path / "a", config, 64)


@pytest.mark.parametrize(
    ("tensors", "settings", "message"),
    [
        (lambda c: pair("self_attn.q_proj", 8, c.q_size, c.hidden_size), {}, "rank 8, over the limit of 4"),
        (lambda c: pair("mlp.gate_proj", 2, c.intermediate_size + 1, c.hidden_size), {}, "made for another base model"),
        (lambda c: pair("self_attn.q_proj", 2, c.q_size, c.hidden_size, layer=9), {}, "targets layer 9"),
        (lambda c: pair("lm_head", 2, c.vocab_size, c.hidden_size), {}, "is not one the engine adapts"),
        (lambda c: pair("self_attn.q_proj", 2, c.q_size, c.hidden_size), {"use_dora": True}, "DoRA"),
        (lambda c: pair("self_attn.q_proj", 2, c.q_size, c.hidden_size), {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        (lambda c: pair("self_attn.q_proj", 2, c.q_size, c.hidden_size), {"peft_type": "IA3"}, "IA3"),
        (lambda c: pair("self_attn.q_proj", 2, c.q_size, c.hidden_size), {"r": 4, "rank_pattern": {}}, "rank 2 but adapter_config.json says 4"),
    ],
)  # fmt: skip
def test_refusals_leave_the_registry_as_it_was(
    config: ModelConfig, tmp_path: Path, tensors: Any, settings: dict, message: str
) -> None:
    registry = LoraRegistry(config, 4, None, torch.float32, torch.device("cpu"))
    good = write(tmp_path / "good", pair("self_attn.q_proj", 2, config.q_size, config.hidden_size))
    registry.add("x", good)
    bad = write(tmp_path / "bad", tensors(config), **settings)
    with pytest.raises(LoraLoadError, match=message):
        registry.add("x", bad)
    assert registry.paths == {"x": str(good)} and registry.loaded == ["x"]
    with pytest.raises(UnknownLoraError):
        registry.adapters({"y"})


def test_missing_files_are_refused(config: ModelConfig, tmp_path: Path) -> None:
    with pytest.raises(LoraLoadError, match="not a directory"):
        load_peft_adapter("a", tmp_path / "nothing", config, 64)
    with pytest.raises(LoraLoadError, match="not a PEFT adapter"):
        load_peft_adapter("a", tmp_path, config, 64)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(LoraLoadError, match="has no adapter_model.safetensors"):
        load_peft_adapter("a", tmp_path, config, 64)
    (tmp_path / "adapter_model.bin").write_bytes(b"a pickle")
    with pytest.raises(LoraLoadError, match="only adapter_model.bin, a pickle, .* safe_seria"):
        load_peft_adapter("a", tmp_path, config, 64)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraLoadError, match="not a readable safetensors"):
        load_peft_adapter("a", tmp_path, config, 64)


def test_an_adapter_of_another_shape_says_both_shapes(config: ModelConfig, tmp_path: Path) -> None:
    inter, hidden = config.intermediate_size, config.hidden_size
    tensors = pair("mlp.gate_proj", 2, inter + 1, hidden)
    message = (
        f"mlp.gate_proj: the adapter's shape is {inter + 1} x {hidden} \\(out x in\\), "
        f"the base model's is {inter} x {hidden}: made for another base model"
    )
    with pytest.raises(LoraLoadError, match=message):
        load_peft_adapter("a", write(tmp_path / "a", tensors), config, 64)


def test_a_gguf_lora_file_is_refused_as_one(config: ModelConfig, tmp_path: Path) -> None:
    """llama.cpp's LoRA format: the refusal says so, not merely that a file is no directory."""
    gguf = tmp_path / "lora.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(LoraLoadError, match="is a GGUF file: llama.cpp's GGUF LoRA files are not"):
        load_peft_adapter("a", gguf, config, 64)
    other = tmp_path / "notes.txt"
    other.write_text("not an adapter")
    with pytest.raises(LoraLoadError, match="is not a directory"):
        load_peft_adapter("a", other, config, 64)


def test_held_adapters_stay_in_memory_past_max_loaded(config: ModelConfig, tmp_path: Path) -> None:
    """An adapter a request in flight holds is never dropped (its step reads no file); one
    dropped is read back off the step (``read``, ``install``) and held from then on."""
    registry = LoraRegistry(config, 4, 1, torch.float32, torch.device("cpu"))
    paths = {
        name: write(tmp_path / name, pair("self_attn.q_proj", 2, config.q_size, config.hidden_size))
        for name in ("a", "b", "c")
    }
    for name, path in paths.items():
        registry.add(name, path)
    assert registry.loaded == ["c"]
    assert registry.hold("c") and not registry.hold("a")
    registry.install("a", registry.read("a"))
    for name in ("a", "c"):
        paths[name].joinpath("adapter_model.safetensors").unlink()
    registry.adapters({"b"})  # another adapter's step, past max_loaded: a and c stay
    assert sorted(registry.loaded) == ["a", "b", "c"]
    assert set(registry.adapters({"a", "c"})) == {"a", "c"}
    assert registry.loads_from_disk == 2
    registry.release_all_but({"a"})
    registry.adapters({"a"})
    assert registry.loaded == ["a"]
    with pytest.raises(LoraLoadError, match="has no adapter_model.safetensors"):
        registry.read("c")
    assert registry.loaded == ["a"] and registry.remove("c") and not registry.hold("c")
