"""HF transformers' float32 prompt logprobs on a checkpoint: the oracle of the scoring tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.server_support import tiny_model_dir


class HFScorer:
    def __init__(self, directory: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def logprobs(self, prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row p scores the token at p + 1."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1)


# The scoring tests' fixtures (imported by the test modules that use them; module-scoped there)
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server tests' tiny llama with weights nearer a real model's scale: its float32
    logprobs agree with HF's to 1e-4 (with the server tests' initializer range 0.5 the logits
    grow so large that only their relative error is that small)."""
    return tiny_model_dir(tmp_path_factory, initializer_range=0.2)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFScorer:
    return HFScorer(model_dir)
