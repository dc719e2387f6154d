"""The draft model of speculative decoding (``speculative = {"method": "draft", "model": M}``).

    draft = load_draft_model(config, target_dir, dtype, device)    # weights, checked
    proposer = bind_draft_model(draft, layout, config, dtype, device, target_vocab_size)

It is loaded by the target's loader (a Hugging Face directory, a GGUF, a known model name; the
same ``quantization``), on the target's device and dtype, and must share the target's tokenizer
(the same token ids for the same text: its guesses are the target's token ids). Its KV pool has
as many token slots as the target's, in the draft's shape (speculative/draft/draft_proposer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from asyncengine.cache.manager import KVCacheManager
from asyncengine.cache.page_table import PageTable
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.core.executor_api import KVLayout
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.loader import load_hf_config
from asyncengine.executor.loader.quantized import load_model
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.quant_formats import QuantizedTensor
from asyncengine.speculative.draft.draft_proposer import DraftProposer
from asyncengine.text.tokenizer import Tokenizer


@dataclass(slots=True)
class DraftModel:
    """A loaded draft model, its weights not yet on the device's runner."""

    name: str
    model_dir: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedTensor]

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        mc = self.config
        return KVPool.token_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)


def _error(name: str, why: str) -> ConfigError:
    return ConfigError(f"config key 'speculative': speculative.model = {name!r}: {why}")


def load_draft_model(
    config: EngineConfig, target_dir: Path, dtype: torch.dtype, device: torch.device
) -> DraftModel:
    """The draft model ``config.speculation`` names; a ConfigError naming
    ``speculative.model`` when it cannot be loaded or its tokenizer is not the target's."""
    settings = config.speculation
    if settings is None or settings.model is None:
        raise ValueError("the speculative config names no draft model")
    name = settings.model
    try:
        loaded = load_model(name, dtype, device, config.quantization)
        model_config = ModelConfig.from_hf_dict(load_hf_config(loaded.model_dir))
        draft_vocab = Tokenizer(loaded.model_dir).backend.get_vocab(with_added_tokens=True)
    except (ValueError, OSError) as error:
        raise _error(name, f"cannot load it: {error}") from None
    target_vocab = Tokenizer(target_dir).backend.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        raise _error(
            name,
            f"its tokenizer is not the target model's ({_vocab_difference(draft_vocab, target_vocab)})",
        )
    return DraftModel(name, loaded.model_dir, model_config, loaded.weights)


def _vocab_difference(draft: dict[str, int], target: dict[str, int]) -> str:
    """One line on how two vocabularies (token -> id) differ."""
    if len(draft) != len(target):
        return f"{len(draft)} tokens against {len(target)}"
    for token, token_id in target.items():
        if draft.get(token) != token_id:
            return (
                f"token {token!r} is id {draft.get(token)} in the draft, {token_id} in the target"
            )
    return "the same tokens, other ids"


def bind_draft_model(
    draft: DraftModel,
    layout: KVLayout,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    target_vocab_size: int,
) -> DraftProposer:
    """The draft's runner over a pool of ``layout``'s token slots in the draft's shape, its
    page accounting (rows as many as the target's), as a proposer."""
    mc = draft.config
    pool = KVPool.for_model(mc, layout.num_pages, layout.page_size, dtype, device)
    runner = ModelRunner(
        mc,
        draft.weights,
        pool,
        PageTable(layout.max_rows, layout.max_pages_per_row),
        dtype=dtype,
        device=device,
        backend=config.attention_backend,
        max_batch_size=config.max_running_requests,
        deterministic=config.deterministic,
        dense_weight_bytes=config.dense_weight_bytes,
    )
    kv = KVCacheManager(
        layout.num_pages,
        layout.page_size,
        layout.max_rows,
        layout.max_pages_per_row,
        enable_prefix_cache=False,
    )
    return DraftProposer(runner, kv, target_vocab_size)
