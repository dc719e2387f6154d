"""Logit penalties and token bans, applied in place to a [batch, vocab] float32 logits tensor.

Every function works on a subset of the batch rows and is sparse: its cost grows with the number
of penalised tokens, never with batch * vocab. Token ids outside ``[0, vocab)`` are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np
import torch


def token_keys(
    rows: Sequence[int], token_seqs: Sequence[Iterable[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Flat indices ``row * vocab_size + token`` of every (row, token) occurrence, duplicates kept.

    ``token_seqs[j]`` holds the tokens of batch row ``rows[j]``.
    """
    seqs = [seq if isinstance(seq, (list, tuple)) else list(seq) for seq in token_seqs]
    lengths = [len(seq) for seq in seqs]
    # numpy reads a long list of Python ints several times faster than torch.tensor does
    tokens = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=sum(lengths))
    row_of_token = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    keys = row_of_token[in_vocab] * vocab_size + tokens[in_vocab]
    return torch.from_numpy(keys).to(device)


def _per_row(
    values: Sequence[float], rows: Sequence[int], batch_size: int, device: torch.device
) -> torch.Tensor:
    """A [batch] float32 tensor holding ``values[j]`` at ``rows[j]`` (zero elsewhere)."""
    table = torch.zeros(batch_size, dtype=torch.float32)
    table[torch.tensor(list(rows), dtype=torch.int64)] = torch.tensor(
        list(values), dtype=torch.float32
    )
    return table.to(device)


def apply_repetition_penalty(
    logits: torch.Tensor,
    rows: Sequence[int],
    token_seqs: Sequence[Iterable[int]],
    penalties: Sequence[float],
) -> None:
    """HF semantics: every distinct token seen in the row's context (prompt and generated tokens)
    has its logit divided by the penalty when positive and multiplied by it otherwise, once."""
    if not rows:
        return
    batch_size, vocab_size = logits.shape
    flat = logits.view(-1)
    keys = torch.unique(token_keys(rows, token_seqs, vocab_size, logits.device))
    penalty = _per_row(penalties, rows, batch_size, logits.device)[keys // vocab_size]
    values = flat[keys]
    flat[keys] = torch.where(values > 0, values / penalty, values * penalty)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    output_seqs: Sequence[Iterable[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI semantics over generated tokens only:
    ``logit -= presence * (count > 0) + frequency * count``."""
    if not rows:
        return
    batch_size, vocab_size = logits.shape
    keys, counts = torch.unique(
        token_keys(rows, output_seqs, vocab_size, logits.device), return_counts=True
    )
    key_rows = keys // vocab_size
    presence_of_key = _per_row(presence, rows, batch_size, logits.device)[key_rows]
    frequency_of_key = _per_row(frequency, rows, batch_size, logits.device)[key_rows]
    logits.view(-1).index_add_(
        0, keys, -(presence_of_key + frequency_of_key * counts.to(logits.dtype))
    )


def ban_tokens(logits: torch.Tensor, rows: Sequence[int], banned: Sequence[Iterable[int]]) -> None:
    """Set the logits of ``banned[j]`` in row ``rows[j]`` to -inf."""
    if not rows:
        return
    keys = token_keys(rows, banned, logits.shape[1], logits.device)
    logits.view(-1)[keys] = float("-inf")
