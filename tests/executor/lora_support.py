"""Adapters for the LoRA tests, written by scripts/make_lora.py (with peft), and the HF + PEFT
oracle: the base model with one adapter, not merged, float32."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# name -> (rank, targets, alpha, rslora): ranks and targets differ, one scales by sqrt(rank)
ADAPTERS: dict[str, tuple[int, tuple[str, ...], float, bool]] = {
    "r4": (4, ("q_proj", "v_proj"), 8.0, False),
    "r8": (
        8,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        4.0,
        False,
    ),
    "r16": (16, ("k_proj", "o_proj", "gate_proj", "down_proj"), 8.0, True),
}


@cache
def make_lora_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_script_make_lora", REPO_ROOT / "scripts" / "make_lora.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def write_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """The ADAPTERS for the base model at ``model_dir``, under ``root`` (written once)."""
    script = make_lora_script()
    out: dict[str, Path] = {}
    for i, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items()):
        path = root / name
        if not (path / "adapter_model.safetensors").is_file():
            script.random_adapter(
                fresh_hf_model(model_dir), path, rank, targets, alpha, rslora, seed=i
            )
        out[name] = path
    return out


class PeftOracle:
    """HF + PEFT logits and greedy tokens, one model per adapter (None: the base)."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel

        self.models: dict[str | None, Any] = {None: fresh_hf_model(model_dir)}
        for name, path in adapters.items():
            model = PeftModel.from_pretrained(fresh_hf_model(model_dir), str(path))
            self.models[name] = model.eval()

    def logits(self, lora: str | None, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.models[lora](input_ids=torch.tensor([tokens])).logits[0].float()

    def embedding(self, lora: str | None, tokens: list[int]) -> torch.Tensor:
        """The mean-pooled, normalized final hidden states (the engine's default pooling)."""
        model = self.models[lora]
        causal_lm = model.get_base_model() if lora is not None else model
        with torch.no_grad():
            hidden = causal_lm.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        pooled = hidden.double().mean(dim=0)
        return pooled / pooled.norm()

    def greedy(self, lora: str | None, prompt: list[int], n: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(self.logits(lora, tokens)[-1].argmax()))
        return tokens[len(prompt) :]
