"""Loading HF directories (single file and sharded), eos ids, and model name/path resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncengine.executor.loader import (
    KNOWN_MODELS,
    ModelFilesError,
    UnknownModelError,
    load_eos_token_ids,
    load_hf_config,
    load_weights,
    resolve_model,
    safetensors_files,
)


def _tiny_llama(tie: bool, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (directory, the state dict that was saved)."""
    root = tmp_path_factory.mktemp("hf_dirs")
    out: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}
    for name, tie, shard in (
        ("single", False, None),
        ("tied", True, None),
        ("sharded", False, "20KB"),
    ):
        model = _tiny_llama(tie, seed=len(out))
        directory = root / name
        if shard is None:
            model.save_pretrained(directory)
        else:
            model.save_pretrained(directory, max_shard_size=shard)
        out[name] = (directory, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def test_single_file_weights_equal_the_saved_state_dict(saved) -> None:
    directory, state = saved["single"]
    weights = load_weights(directory, torch.float32)
    assert weights.keys() == state.keys()
    for name, tensor in state.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name


def test_tied_checkpoint_has_no_lm_head_and_config_says_tied(saved) -> None:
    directory, state = saved["tied"]
    weights = load_weights(directory, torch.float32)
    assert "lm_head.weight" not in weights
    assert weights.keys() == state.keys() - {"lm_head.weight"}
    assert load_hf_config(directory)["tie_word_embeddings"] is True


def test_sharded_checkpoint_loads_every_shard(saved) -> None:
    directory, state = saved["sharded"]
    files = safetensors_files(directory)
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(files) > 1
    weights = load_weights(directory, torch.float32)
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in state.items())


def test_weights_are_cast_to_the_target_dtype(saved) -> None:
    directory, state = saved["sharded"]
    weights = load_weights(directory, torch.bfloat16)
    for name, tensor in state.items():
        assert weights[name].dtype == torch.bfloat16
        assert weights[name].device.type == "cpu"
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_config_is_returned_as_a_dict(saved) -> None:
    config = load_hf_config(saved["single"][0])
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (32, 4, 2)


def test_missing_shard_is_reported(saved, tmp_path: Path) -> None:
    directory = tmp_path / "broken"
    shutil.copytree(saved["sharded"][0], directory)
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelFilesError, match="missing"):
        load_weights(directory, torch.float32)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ModelFilesError, match="config.json"):
        resolve_model(str(tmp_path), torch.float32)


def test_eos_ids_merge_generation_config_first(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_eos_token_ids(tmp_path) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert load_eos_token_ids(tmp_path) == [7, 2, 9]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3]}))
    assert load_eos_token_ids(tmp_path) == [7, 2, 9, 3]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelFilesError, match="eos_token_id"):
        load_eos_token_ids(tmp_path)


def test_existing_directory_resolves_to_itself(saved) -> None:
    directory = saved["single"][0]
    assert resolve_model(str(directory), torch.float32) == directory


def test_unknown_name_lists_known_names_and_mentions_paths() -> None:
    with pytest.raises(UnknownModelError) as error:
        resolve_model("no-such-model-anywhere", torch.float32)
    message = str(error.value)
    assert "no-such-model-anywhere" in message
    assert all(name in message for name in KNOWN_MODELS)
    assert "path" in message and ".gguf" in message


def test_loaded_weights_do_not_keep_the_file_mapped(saved) -> None:
    """Each tensor owns its memory: a view of safetensors' memory map would keep the whole file
    (every page read) resident for as long as any one weight lives."""
    directory, _ = saved["single"]
    weights = load_weights(directory, torch.float32)
    files = [str(p.resolve()) for p in directory.glob("*.safetensors")]
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps on this platform")
    mapped = maps.read_text()
    assert weights and not any(f in mapped for f in files)
