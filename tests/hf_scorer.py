"""HF transformers' float32 prompt logprobs on a checkpoint: the oracle of the scoring tests."""

from __future__ import annotations

from pathlib import Path

import torch


class HFScorer:
    def __init__(self, directory: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def logprobs(self, prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row p scores the token at p + 1."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1)
