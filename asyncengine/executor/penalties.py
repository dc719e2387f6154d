"""Logit penalties, biases, token bans and grammar masks, applied in place to a [batch, vocab]
float32 logits tensor.

Every function works on a subset of the batch rows. All but the grammar mask are sparse: their
cost grows with the number of penalised tokens, never with batch * vocab. Token ids outside
``[0, vocab)`` are ignored.
"""

from __future__ import annotations

from collections import OrderedDict
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


def keep_only_tokens(
    logits: torch.Tensor, rows: Sequence[int], allowed: Sequence[Iterable[int]]
) -> None:
    """Set every logit of row ``rows[j]`` to -inf but those of the tokens ``allowed[j]``."""
    if not rows:
        return
    keys = token_keys(rows, allowed, logits.shape[1], logits.device)
    kept = logits.view(-1)[keys]
    logits[list(rows)] = float("-inf")
    logits.view(-1)[keys] = kept


def bad_word_bans(output_ids: Sequence[int], bad_words: Sequence[Sequence[int]]) -> list[int]:
    """The tokens a row may not sample next: the last token of each bad word whose other
    tokens end the output (vLLM's bad_words)."""
    banned = []
    end = len(output_ids)
    for word in bad_words:
        head = len(word) - 1
        if head > end:
            continue
        # compared from the end, no copies: most words part at the output's last token
        if all(output_ids[end - k] == word[head - k] for k in range(1, head + 1)):
            banned.append(word[-1])
    return banned


class LogitBiasArrays:
    """Each request's logit_bias as (token ids, biases) arrays, made once per request rather
    than once per step: keyed by the dict's identity (a request keeps the same dict), the
    dict held so that an id is not reused while its entry lives."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._by_id: OrderedDict[int, tuple[dict[int, float], np.ndarray, np.ndarray]] = (
            OrderedDict()
        )

    def get(self, bias: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
        entry = self._by_id.get(id(bias))
        if entry is not None and entry[0] is bias:
            self._by_id.move_to_end(id(bias))
            return entry[1], entry[2]
        tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self._by_id[id(bias)] = (bias, tokens, values)
        if len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)
        return tokens, values


def apply_logit_bias(
    logits: torch.Tensor,
    rows: Sequence[int],
    biases: Sequence[dict[int, float]],
    arrays: LogitBiasArrays | None = None,
) -> None:
    """OpenAI's logit_bias: ``biases[j][token]`` is added to row ``rows[j]``'s logit of token,
    all rows in one scatter-add; ``arrays`` keeps each dict's arrays between steps."""
    if not rows:
        return
    table = arrays if arrays is not None else LogitBiasArrays()
    vocab_size = logits.shape[1]
    pairs = [table.get(bias) for bias in biases]
    tokens = np.concatenate([tokens for tokens, _ in pairs])
    values = np.concatenate([values for _, values in pairs])
    row_of_entry = np.repeat(np.asarray(rows, dtype=np.int64), [len(t) for t, _ in pairs])
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    keys = row_of_entry[in_vocab] * vocab_size + tokens[in_vocab]
    logits.view(-1).index_add_(
        0,
        torch.from_numpy(keys).to(logits.device),
        torch.from_numpy(values[in_vocab]).to(device=logits.device, dtype=logits.dtype),
    )


def allowed_tokens(bitmasks: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Bool [n, vocab] from int32 CPU bitmasks [n, words]: bit i of word j allows token
    32 j + i (xgrammar's layout: little-endian words, so the bytes unpack little-endian)."""
    words = np.ascontiguousarray(bitmasks.numpy())
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].view(np.bool_)


def apply_token_bitmasks(
    logits: torch.Tensor, rows: Sequence[int], bitmasks: Sequence[torch.Tensor]
) -> list[int]:
    """Set the logits of row ``rows[j]`` that ``bitmasks[j]`` does not allow to -inf; return
    the rows left without any finite logit.

    On CPU in numpy, row by row in place (single-threaded: a handful of whole-row torch ops
    costs more, as torch wakes its thread pool for each); on CUDA with xgrammar's kernel."""
    if not rows:
        return []
    words = torch.stack([m.to(torch.int32).cpu() for m in bitmasks])
    if logits.device.type == "cuda":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, words.to(logits.device), indices=list(rows))
        finite = torch.isfinite(logits[list(rows)]).any(dim=-1).tolist()
        return [row for row, ok in zip(rows, finite, strict=True) if not ok]
    allowed = allowed_tokens(words, logits.shape[1])
    array = logits.numpy()
    dead = []
    for j, row in enumerate(rows):
        values = array[row]
        np.putmask(values, ~allowed[j], -np.inf)
        if not np.isfinite(values).any():
            dead.append(row)
    return dead
