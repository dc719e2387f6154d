"""Logit penalties, biases, token bans and grammar masks, applied in place to a [batch, vocab]
float32 logits tensor.

Every function works on a subset of the batch rows. All but the grammar mask are sparse: their
cost grows with the number of penalised tokens, never with batch * vocab. The penalties read
each row's distinct tokens from a ``PenaltyState`` kept between steps, so that a step reads only
the tokens a row gained, never its whole context again. Token ids outside ``[0, vocab)`` are
ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

_NO_TOKENS = np.zeros(0, dtype=np.int64)
_NO_COUNTS = np.zeros(0, dtype=np.int32)


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


def _in_vocab(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """The tokens of sorted ``tokens`` in ``[0, vocab_size)`` (a view)."""
    lo, hi = np.searchsorted(tokens, (0, vocab_size))
    return tokens[lo:hi]


def _row_keys(rows: Sequence[int], tokens: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """Flat indices ``rows[j] * vocab_size + token`` of every token of ``tokens[j]``."""
    lengths = [len(t) for t in tokens]
    row_of_token = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    return row_of_token * vocab_size + np.concatenate([*tokens, _NO_TOKENS])


def _per_token(
    values: Sequence[float], tokens: Sequence[np.ndarray], device: torch.device
) -> torch.Tensor:
    """A float32 tensor holding ``values[j]`` once for every token of ``tokens[j]``."""
    per_row = np.asarray(values, dtype=np.float32)
    return torch.from_numpy(np.repeat(per_row, [len(t) for t in tokens])).to(device)


def apply_repetition_penalty(
    logits: torch.Tensor,
    rows: Sequence[int],
    contexts: Sequence[np.ndarray],
    penalties: Sequence[float],
) -> None:
    """HF semantics: every distinct token seen in the row's context (prompt and generated tokens)
    has its logit divided by the penalty when positive and multiplied by it otherwise, once.

    ``contexts[j]``: the distinct tokens of row ``rows[j]``'s context, sorted
    (``PenaltyState.context``)."""
    if not rows:
        return
    vocab_size = logits.shape[1]
    tokens = [_in_vocab(context, vocab_size) for context in contexts]
    keys = torch.from_numpy(_row_keys(rows, tokens, vocab_size)).to(logits.device)
    penalty = _per_token(penalties, tokens, logits.device)
    flat = logits.view(-1)
    values = flat[keys]
    flat[keys] = torch.where(values > 0, values / penalty, values * penalty)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    outputs: Sequence[tuple[np.ndarray, np.ndarray]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI semantics over generated tokens only:
    ``logit -= presence * (count > 0) + frequency * count``.

    ``outputs[j]``: the distinct tokens of row ``rows[j]``'s output, sorted, and their counts
    (``PenaltyState.output_tokens`` and ``output_counts``)."""
    if not rows:
        return
    vocab_size = logits.shape[1]
    tokens: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for row_tokens, row_counts in outputs:
        lo, hi = np.searchsorted(row_tokens, (0, vocab_size))
        tokens.append(row_tokens[lo:hi])
        counts.append(row_counts[lo:hi])
    keys = torch.from_numpy(_row_keys(rows, tokens, vocab_size)).to(logits.device)
    count = torch.from_numpy(np.concatenate([*counts, _NO_COUNTS])).to(logits.device)
    presence_of_key = _per_token(presence, tokens, logits.device)
    frequency_of_key = _per_token(frequency, tokens, logits.device)
    logits.view(-1).index_add_(
        0, keys, -(presence_of_key + frequency_of_key * count.to(logits.dtype))
    )


def distinct_counts(tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of ``tokens``, sorted, and how many times each occurs."""
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    distinct, counts = np.unique(array, return_counts=True)
    return distinct, counts.astype(np.int32)


def _positions(tokens: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of sorted distinct ``new`` goes in sorted ``tokens``, and whether it is there."""
    at = np.searchsorted(tokens, new)
    if not len(tokens):
        return at, np.zeros(len(new), dtype=np.bool_)
    return at, tokens[np.minimum(at, len(tokens) - 1)] == new


def _merge_tokens(tokens: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted distinct ``tokens`` with sorted distinct ``new`` added (a new array)."""
    at, found = _positions(tokens, new)
    return np.insert(tokens, at[~found], new[~found])


def _merge_counts(
    tokens: np.ndarray, counts: np.ndarray, new: np.ndarray, new_counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` and their ``counts`` with ``new`` occurring ``new_counts`` more times (new
    arrays): the distinct tokens of both, sorted, with the sums of their counts."""
    at, found = _positions(tokens, new)
    merged = np.insert(tokens, at[~found], new[~found])
    merged_counts = np.insert(counts, at[~found], new_counts[~found])
    merged_counts[np.searchsorted(merged, new[found])] += new_counts[found]
    return merged, merged_counts


@dataclass(slots=True)
class PenaltyState:
    """A row's tokens as its penalties read them, over its prompt and ``output[:read]``: the
    distinct tokens of both (repetition), and the distinct tokens of the output with their
    counts (presence, frequency), sorted. Holds the lists it read, so that their ids, which
    key it, are not reused while it lives."""

    prompt: list[int]
    output: list[int]
    context: np.ndarray
    prompt_len: int
    output_tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS)
    output_counts: np.ndarray = field(default_factory=lambda: _NO_COUNTS)
    read: int = 0
    last: int = 0  # output[read - 1]: a rewrite of it means the output changed
    used: int = 0  # the PenaltyStates call that used it last

    def add(self, tokens: np.ndarray) -> None:
        """Take in ``tokens``, appended to the output."""
        new, counts = distinct_counts(tokens)
        self.output_tokens, self.output_counts = _merge_counts(
            self.output_tokens, self.output_counts, new, counts
        )
        self.context = _merge_tokens(self.context, new)

    def context_with(self, guessed: Sequence[int]) -> np.ndarray:
        """``context`` with the tokens ``guessed`` after the output."""
        if not guessed:
            return self.context
        return _merge_tokens(self.context, distinct_counts(guessed)[0])

    def output_with(self, guessed: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``output_tokens`` and ``output_counts`` with the tokens ``guessed`` after them."""
        if not guessed:
            return self.output_tokens, self.output_counts
        return _merge_counts(self.output_tokens, self.output_counts, *distinct_counts(guessed))


class PenaltyStates:
    """Each row's ``PenaltyState`` kept between steps, so that a step reads only the tokens a
    row gained rather than its whole context: keyed by the identity of the row's prompt and
    output lists (a request keeps both for its life, and appends to its output). An output
    found shorter than the state read, or changed at its last token read, and a prompt of
    another length, are read again whole (an output cut and grown back past that token
    between two calls is not seen: the engine cuts one only as its request ends). A state
    unused for ``idle_calls`` calls goes (its request finished or waits), and so do the
    least recently used past ``capacity``."""

    def __init__(self, capacity: int = 4096, idle_calls: int = 8) -> None:
        self.capacity = capacity
        self.idle_calls = idle_calls
        self.tokens_read = 0  # prompt and output tokens read from the rows' lists, all calls
        self._calls = 0
        self._states: OrderedDict[tuple[int, int], PenaltyState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def rows(self, lists: Sequence[tuple[list[int], list[int]]]) -> list[PenaltyState]:
        """The state of each (prompt, output) pair, brought up to the output's end."""
        self._calls += 1
        states = [self._row(prompt, output) for prompt, output in lists]
        while self._states:
            key, oldest = next(iter(self._states.items()))
            if len(self._states) <= self.capacity and oldest.used > self._calls - self.idle_calls:
                break
            del self._states[key]
        return states

    def _row(self, prompt: list[int], output: list[int]) -> PenaltyState:
        key = (id(prompt), id(output))
        state = self._states.get(key)
        new = None if state is None else _new_tokens(state, prompt, output)
        if state is None or new is None:
            state = PenaltyState(prompt, output, distinct_counts(prompt)[0], len(prompt))
            self.tokens_read += len(prompt)
            self._states[key] = state
            new = output[:]
        if new:
            state.add(np.asarray(new, dtype=np.int64))
            state.read += len(new)
            state.last = new[-1]
            self.tokens_read += len(new)
        state.used = self._calls
        self._states.move_to_end(key)
        return state


def _new_tokens(state: PenaltyState, prompt: list[int], output: list[int]) -> list[int] | None:
    """The tokens ``output`` gained since ``state`` read it; None when it changed otherwise (cut
    shorter than the state read, or rewritten at the last token read) or ``prompt`` changed
    length. One slice of the list: the loop thread may append to it meanwhile."""
    if state.prompt_len != len(prompt):
        return None
    if not state.read:
        return output[:]
    tail = output[state.read - 1 :]
    if not tail or tail[0] != state.last:
        return None
    return tail[1:]


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


# the bounds a mask byte puts on its 8 tokens' logits, met with np.fmin: -inf where its bit
# refuses (a NaN logit too), NaN where it allows, which fmin passes over (bit i of a byte is
# token 8 k + i, as ``allowed_tokens`` reads them)
_BYTE_BOUNDS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(np.nan),
    np.float32(-np.inf),
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
    mask_bytes = np.ascontiguousarray(words.numpy()).view(np.uint8)
    array = logits.numpy()
    bounds = np.empty((mask_bytes.shape[1], 8), dtype=np.float32)
    row_bounds = bounds.reshape(-1)[: logits.shape[1]]
    dead = []
    for j, row in enumerate(rows):
        values = array[row]
        # each token's bound, looked up 8 at a time and met branch-free, where a masked store
        # mispredicts on every word mixing allowed and refused tokens (fivefold at 152k)
        _BYTE_BOUNDS.take(mask_bytes[j], axis=0, out=bounds)
        np.fmin(values, row_bounds, out=values)
        if not np.isfinite(values).any():
            dead.append(row)
    return dead
