"""How a model's embeddings are pooled, as its files say (sentence-transformers' layout)."""

from __future__ import annotations

import json
from pathlib import Path


def model_pooling(model_dir: str | Path, configured: str) -> str:
    """ "mean" or "last": ``configured`` unless it is "auto"; then the sentence-transformers
    pooling config of ``model_dir`` (``1_Pooling/config.json``: last-token or mean), else
    "mean" (the embedded model and plain chat checkpoints have none)."""
    if configured != "auto":
        return configured
    path = Path(model_dir) / "1_Pooling" / "config.json"
    if not path.is_file():
        return "mean"
    modes = json.loads(path.read_text())
    if modes.get("pooling_mode_lasttoken"):
        return "last"
    if modes.get("pooling_mode_mean_tokens"):
        return "mean"
    named = [key for key, on in modes.items() if key.startswith("pooling_mode_") and on]
    raise ValueError(f"{path}: pooling {named} is not supported (mean or last token only)")
