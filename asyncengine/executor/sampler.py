"""Vectorized sampler: one [batch, vocab] logits tensor in, one token (and logprobs) per row out.

Order of operations for every row:

1. Logprobs (when asked) are ``log_softmax`` of the *raw* logits as the model produced them,
   before penalties, bans and temperature (vLLM's default ``raw_logprobs``).
2. Repetition penalty (HF), then presence / frequency penalties (OpenAI), then ``logit_bias``,
   then, while fewer than ``min_new_tokens`` tokens were generated, the EOS ids (unless
   ``ignore_eos``) and the request's ``stop_token_ids`` are banned (set to -inf), and so are
   the tokens outside ``allowed_token_ids`` and the bad words' next tokens. Last, a
   structured-output row keeps only the tokens its grammar allows (``token_bitmask``); should
   the bans leave it none, the grammar wins (the row is masked without the bans).
3. Greedy rows (temperature 0, or below ``GREEDY_TEMPERATURE``) take the argmax of the processed logits (first index on ties).
4. Other rows sample from ``p ~ exp((logit - max) / temperature)`` restricted by the filters,
   each a per-row threshold on the logit (a token tied with a threshold is kept):
   top-k keeps logits >= the k-th largest; top-p keeps the smallest prefix of the sorted
   distribution, renormalised over the top-k set, whose mass reaches ``top_p``; min-p keeps
   ``p >= min_p * p_max``. The token is drawn by inverse CDF, in vocabulary order, over the kept
   tokens with one uniform number per row.

Speed: no full sort in the common case. Filtered rows work on candidates, the logits at or above
a per-row lower bound found from block maxima (see ``Sampler._filtered_tokens``); only rows
without any filter (and top-p without top-k, for its total mass) touch the whole vocabulary,
with elementwise passes, block sums and a two-level inverse CDF (a block, then a token inside
it). Large temporaries live in buffers reused across calls: fresh ones page-fault every step.

Reproducibility: the uniform of a row with a seed is a pure function of (seed, number of tokens
generated so far), a splitmix64 counter hash computed with int64 tensor ops for all rows at once.
Every other step is elementwise, a per-row max / sort / top-k, a sum over a fixed block of one
row, or a sequential per-row cumsum; which path a row takes depends on that row alone; and the
thresholds depend on sorted values only (never on how ties are ordered or how wide a padded
buffer was). So a seeded row gets the same token whatever else shares the batch and wherever it
sits. (A whole-row ``sum`` would not do: torch splits a lone row across threads, not a row of a
larger batch.) Rows without a seed draw their uniform from the sampler's own generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch

from asyncengine.common.plan import SamplingInfo, TokenLogprobs
from asyncengine.executor.penalties import (
    LogitBiasArrays,
    PenaltyStates,
    apply_logit_bias,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_token_bitmasks,
    bad_word_bans,
    ban_tokens,
    keep_only_tokens,
)

DRAW_BLOCK = 1024  # tokens per block of the two-level inverse-CDF draw over whole rows
CANDIDATE_BLOCK = 32  # tokens per block whose maxima bound the candidates
MAX_CANDIDATES = 4096  # rows with more candidates than this are packed and sorted apart

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """The two's-complement int64 with the same low 64 bits as ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; clearing the copied sign bits makes it logical.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of ``z`` (int64 tensor, wrapping arithmetic): add the golden gamma, then mix."""
    z = z + _GOLDEN_GAMMA
    z = (z ^ _shift_right_logical(z, 30)) * _MIX_1
    z = (z ^ _shift_right_logical(z, 27)) * _MIX_2
    return z ^ _shift_right_logical(z, 31)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in [0, 1) per (seed, step) pair of int64 tensors, a pure function."""
    bits = splitmix64(splitmix64(seeds) + steps)
    return _shift_right_logical(bits, 40).to(torch.float32) * (1.0 / (1 << 24))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 [rows]: the first index of each row's largest logit, a
    row's first NaN where it holds one), through numpy's SIMD argmax for CPU float32 logits
    (the same semantics): torch's reads a 49152-logit row at ~1/10 the rate, no SIMD, and after
    a step has streamed its weights through the caches numpy's shorter call path costs less
    again (one stream's step: ~125 us -> ~65 us, ~110 -> ~8 us warm)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[-1] == 0:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))


class Sampler:
    """Samples one token per logits row; see the module docstring for the exact semantics.

    ``eos_token_ids`` are banned while a request is below its ``min_new_tokens``. ``seed`` seeds
    the generator of rows without a seed of their own. ``top_p_candidate_ratios`` tunes the
    search for top-p thresholds (see ``_filtered_tokens``); it changes speed, never the result.
    Not thread-safe (its generator and buffers are shared by calls): one sampler per worker.
    """

    def __init__(
        self,
        eos_token_ids: Iterable[int] = (),
        seed: int | None = None,
        top_p_candidate_ratios: tuple[float, ...] = (1e-4, 1e-9),
    ) -> None:
        if not all(0.0 < ratio <= 1.0 for ratio in top_p_candidate_ratios):
            raise ValueError("top_p_candidate_ratios must lie in (0, 1]")
        self.eos_token_ids = tuple(eos_token_ids)
        self.top_p_candidate_ratios = tuple(top_p_candidate_ratios)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._buffers = _Buffers()
        self._logit_bias = LogitBiasArrays()
        self._penalty_states = PenaltyStates()

    def sample(
        self, logits: torch.Tensor, sampling: list[SamplingInfo]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Row ``i`` of ``logits`` [B, V] belongs to ``sampling[i]``. ``logits`` is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(sampling):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(sampling)} sampling rows"
            )
        if len(sampling) == 1 and self._plain_greedy(sampling[0]):
            # one stream's greedy row with nothing to apply: after a step has streamed its
            # weights through the caches the general path took ~200 us, this ~155
            return greedy_tokens(logits).tolist(), [None]
        logits = logits.to(torch.float32).contiguous()
        processed = self._apply_penalties_and_bans(logits, sampling)
        sampled_rows = [i for i, info in enumerate(sampling) if not info.params.greedy]
        if not sampled_rows:
            tokens = greedy_tokens(processed)
        else:
            tokens = torch.empty(len(sampling), dtype=torch.int64, device=logits.device)
            greedy_rows = [i for i, info in enumerate(sampling) if info.params.greedy]
            if greedy_rows:
                index = torch.tensor(greedy_rows, device=logits.device)
                tokens[index] = greedy_tokens(self._buffers.rows("gather", processed, index))
            index = torch.tensor(sampled_rows, device=logits.device)
            tokens[index] = self._sample_rows(processed, index, [sampling[i] for i in sampled_rows])
        return tokens.tolist(), self._logprobs(logits, sampling, tokens)

    def plain_greedy(self, sampling: list[SamplingInfo]) -> bool:
        """Whether every row's token is its raw logits' argmax, nothing else asked (no logprobs):
        what a captured greedy step computes on the device (executor/cuda_graph.py)."""
        return all(self._plain_greedy(info) for info in sampling)

    def _plain_greedy(self, info: SamplingInfo) -> bool:
        """A greedy row that neither ``_apply_penalties_and_bans`` nor ``_logprobs`` touches:
        its token is the raw logits' argmax (tests/executor/test_sampler.py holds the two to agree)."""
        p = info.params
        return (
            p.greedy
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and not p.logit_bias
            and p.allowed_token_ids is None
            and not p.bad_words_token_ids  # their bans are checked once, on the full path
            and info.token_bitmask is None
            and not p.logprobs
            and p.top_logprobs <= 0
            and (
                info.output_len() >= p.min_new_tokens
                or not (p.stop_token_ids or (not p.ignore_eos and self.eos_token_ids))
            )
        )

    def _apply_penalties_and_bans(
        self, logits: torch.Tensor, sampling: list[SamplingInfo]
    ) -> torch.Tensor:
        """A penalised copy of ``logits``, or ``logits`` itself when no row has anything to apply."""
        repetition_rows: list[int] = []
        presence_frequency_rows: list[int] = []
        ban_rows: list[int] = []
        banned: list[list[int]] = []
        bias_rows: list[int] = []
        mask_rows: list[int] = []
        allowed_rows: list[int] = []
        for i, info in enumerate(sampling):
            params = info.params
            if params.repetition_penalty != 1.0:
                repetition_rows.append(i)
            if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
                presence_frequency_rows.append(i)
            if params.logit_bias:
                bias_rows.append(i)
            if info.token_bitmask is not None:
                mask_rows.append(i)
            if params.allowed_token_ids is not None:
                allowed_rows.append(i)
            row_banned = _bad_word_bans(info)
            if info.output_len() < params.min_new_tokens:
                row_banned.extend(params.stop_token_ids)
                if not params.ignore_eos:
                    row_banned.extend(self.eos_token_ids)
            if row_banned:
                ban_rows.append(i)
                banned.append(row_banned)
        if not (
            repetition_rows
            or presence_frequency_rows
            or ban_rows
            or bias_rows
            or mask_rows
            or allowed_rows
        ):
            return logits
        processed = self._buffers.empty("processed", logits.shape[0], logits).copy_(logits)
        penalised = sorted({*repetition_rows, *presence_frequency_rows})
        state_list = self._penalty_states.rows(
            [(sampling[i].prompt_ids, sampling[i].output_ids) for i in penalised]
        )
        states = dict(zip(penalised, state_list, strict=True))
        apply_repetition_penalty(
            processed,
            repetition_rows,
            [states[i].context_with(sampling[i].guessed_ids) for i in repetition_rows],
            [sampling[i].params.repetition_penalty for i in repetition_rows],
        )
        apply_presence_frequency_penalties(
            processed,
            presence_frequency_rows,
            [states[i].output_with(sampling[i].guessed_ids) for i in presence_frequency_rows],
            [sampling[i].params.presence_penalty for i in presence_frequency_rows],
            [sampling[i].params.frequency_penalty for i in presence_frequency_rows],
        )
        apply_logit_bias(
            processed,
            bias_rows,
            [sampling[i].params.logit_bias for i in bias_rows],
            self._logit_bias,
        )
        # a tiny repetition penalty divides logits past float32's range: keep them finite (an
        # infinite maximum would make every probability NaN)
        processed.clamp_(max=torch.finfo(processed.dtype).max)
        allowed = [sampling[i].params.allowed_token_ids or [] for i in allowed_rows]
        keep_only_tokens(processed, allowed_rows, allowed)
        ban_tokens(processed, ban_rows, banned)
        if allowed_rows and ban_rows:  # the bans took every allowed token: allowed_token_ids win
            both = sorted(set(allowed_rows) & set(ban_rows))
            finite = torch.isfinite(processed[both]).any(dim=-1).tolist()
            emptied = [row for row, ok in zip(both, finite, strict=True) if not ok]
            processed[emptied] = logits[emptied]
            keep_only_tokens(processed, emptied, [allowed[allowed_rows.index(r)] for r in emptied])
        masks = [torch.as_tensor(sampling[i].token_bitmask) for i in mask_rows]
        dead = apply_token_bitmasks(processed, mask_rows, masks)
        if dead:  # the bans took every token the grammar allows: the grammar wins
            processed[dead] = logits[dead]
            apply_token_bitmasks(processed, dead, [masks[mask_rows.index(r)] for r in dead])
        return processed

    def _sample_rows(
        self, logits: torch.Tensor, row_ids: torch.Tensor, sampling: list[SamplingInfo]
    ) -> torch.Tensor:
        """One token for each row ``row_ids`` of ``logits`` [B, V], all with temperature > 0."""
        device = logits.device
        vocab_size = logits.shape[1]
        params = [info.params for info in sampling]
        rows = _RowParams(
            row_ids=row_ids,
            temperature=torch.tensor([float(p.temperature) for p in params], device=device),
            top_k=torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params], device=device
            ),
            top_p=torch.tensor(
                [float(p.top_p) for p in params], dtype=torch.float64, device=device
            ),
            min_p=torch.tensor([float(p.min_p) for p in params], device=device),
            row_max=logits.amax(dim=-1, keepdim=True).index_select(0, row_ids),
            uniform=self._uniforms(sampling, device),
        )
        is_filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
        if not any(is_filtered):
            return _draw_whole_rows(self._mass(logits, rows), rows.uniform)
        if all(is_filtered):
            return self._filtered_tokens(logits, rows)
        tokens = torch.empty(len(params), dtype=torch.int64, device=device)
        filtered = torch.tensor(is_filtered, device=device)
        unfiltered = (~filtered).nonzero()[:, 0]
        filtered = filtered.nonzero()[:, 0]
        plain = rows.select(unfiltered)
        tokens[unfiltered] = _draw_whole_rows(self._mass(logits, plain), plain.uniform)
        tokens[filtered] = self._filtered_tokens(logits, rows.select(filtered))
        return tokens

    def _uniforms(self, sampling: list[SamplingInfo], device: torch.device) -> torch.Tensor:
        """Per row: the seeded uniform for rows with a seed, the sampler's generator otherwise."""
        uniform = torch.rand(len(sampling), generator=self._generator)
        seeded_rows: list[int] = []
        seeds: list[int] = []
        steps: list[int] = []
        for i, info in enumerate(sampling):
            if info.params.seed is not None:
                seeded_rows.append(i)
                seeds.append(_as_int64(info.params.seed))
                steps.append(info.output_len())
        if seeded_rows:
            uniform[torch.tensor(seeded_rows)] = seeded_uniform(
                torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64)
            )
        return uniform.to(device)

    def _mass(self, logits: torch.Tensor, rows: _RowParams) -> torch.Tensor:
        """``exp((logit - max) / temperature)`` of ``rows`` of ``logits``, [n, V] in a reused
        buffer (valid until the next call)."""
        buffer = self._buffers.empty("mass", rows.row_ids.numel(), logits)
        if _is_every_row(rows.row_ids, logits.shape[0]):
            torch.sub(logits, rows.row_max, out=buffer)
        else:
            torch.index_select(logits, 0, rows.row_ids, out=buffer).sub_(rows.row_max)
        return _scale_in_place(buffer, rows)

    def _filtered_tokens(self, logits: torch.Tensor, rows: _RowParams) -> torch.Tensor:
        """Tokens for ``rows`` of ``logits`` [B, V] (top-k, top-p or min-p), among candidates.

        The candidates of a row are its logits at or above a lower bound that provably holds
        everything the thresholds need, so the kept set is among them:
        - top-k: the k-th largest maximum of blocks of ``CANDIDATE_BLOCK`` logits (k distinct
          logits reach it, so the top-k set and its mass are candidates);
        - top-p without top-k: the logit of a token ``ratio`` times as likely as the best, for
          each of ``top_p_candidate_ratios`` in turn until the candidates hold enough mass to
          contain the nucleus;
        - min-p alone: its own threshold.
        Rows left over (a k above the number of blocks, a nucleus below every ratio) take
        whole rows, fully sorted.
        """
        num_rows = rows.row_ids.numel()
        vocab_size = logits.shape[1]
        device = logits.device
        has_k = rows.top_k > 0
        has_p = rows.top_p < 1.0
        min_p_threshold = rows.row_max[:, 0] + rows.temperature * torch.log(rows.min_p)
        # Top-p without top-k renormalises over the whole row: its mass, by fixed blocks.
        full_mass = torch.ones(num_rows, dtype=torch.float64, device=device)
        needs_mass = (has_p & ~has_k).nonzero()[:, 0]
        if needs_mass.numel():
            block_mass = _block_sums(self._mass(logits, rows.select(needs_mass)))
            full_mass[needs_mass] = torch.cumsum(block_mass, dim=-1)[:, -1].to(torch.float64)

        if 2 * num_rows >= logits.shape[0]:
            block_max = _block_maxima(logits).index_select(0, rows.row_ids)
        else:
            block_max = _block_maxima(self._buffers.rows("gather", logits, rows.row_ids))
        k_bound = _kth_largest(block_max, rows.top_k)
        tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
        solved = torch.zeros(num_rows, dtype=torch.bool, device=device)
        pending = torch.arange(num_rows, device=device)
        for ratio in (*self.top_p_candidate_ratios, None):
            if ratio is None:  # the last resort: whole rows
                whole, groups = pending, []
            else:
                p_bound = rows.row_max[pending, 0] + rows.temperature[pending] * math.log(ratio)
                bound = torch.where(
                    has_k[pending],
                    k_bound[pending],
                    torch.where(has_p[pending], p_bound, min_p_threshold[pending]),
                )
                selected = block_max[pending] >= bound[:, None]
                # Where most blocks reach the bound (or none is set) packing saves nothing: the
                # row is taken whole now, which gives the same thresholds and the same token.
                as_whole = (bound == -math.inf) | (2 * selected.sum(dim=-1) > selected.shape[1])
                whole = pending[as_whole]
                groups = _candidate_groups(
                    logits,
                    selected[~as_whole],
                    bound[~as_whole],
                    pending[~as_whole],
                    rows.row_ids,
                    self._buffers,
                )
            if whole.numel():
                columns = torch.arange(vocab_size, device=device).expand(whole.numel(), -1)
                values = self._buffers.rows("gather", logits, rows.row_ids[whole])
                groups.append((whole, values, columns, True))
            for members, values, columns, complete in groups:
                member_rows = rows.select(members)
                threshold, done = _thresholds(
                    _sorted_descending(values), member_rows, full_mass[members], complete
                )
                threshold = torch.maximum(threshold, min_p_threshold[members])
                drawn = _draw_candidates(values, columns, threshold, member_rows)
                tokens[members[done]] = drawn[done]
                solved[members[done]] = True
            pending = pending[~solved[pending]]
            if not pending.numel():
                break
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, sampling: list[SamplingInfo], tokens: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """``log_softmax`` of the raw logits for the rows that asked: chosen token and top-n."""
        result: list[TokenLogprobs | None] = [None] * len(sampling)
        wanted = [
            i
            for i, info in enumerate(sampling)
            if info.params.logprobs or info.params.top_logprobs > 0
        ]
        if not wanted:
            return result
        index = torch.tensor(wanted, device=logits.device)
        rows = self._buffers.rows("gather", logits, index)
        logprobs = torch.log_softmax(
            rows, dim=-1, out=self._buffers.empty("logprobs", len(wanted), logits)
        )
        chosen = logprobs.gather(1, tokens[index][:, None])[:, 0].tolist()
        top_n = [sampling[i].params.top_logprobs for i in wanted]
        most = min(max(top_n), logprobs.shape[1])
        top_values: list[list[float]] = [[] for _ in wanted]
        top_ids: list[list[int]] = [[] for _ in wanted]
        if most > 0:
            best = torch.topk(logprobs, most, dim=-1)
            top_values, top_ids = best.values.tolist(), best.indices.tolist()
        for j, i in enumerate(wanted):
            n = top_n[j]
            top = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
            result[i] = TokenLogprobs(token_logprob=chosen[j], top=top)
        return result


class _Buffers:
    """Float32 [rows, V] buffers reused across calls, by name: a fresh 50 MB tensor page-faults
    its way in on every step, which costs more than the math done in it."""

    def __init__(self) -> None:
        self._by_name: dict[str, torch.Tensor] = {}

    def empty(self, name: str, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous [num_rows, like.shape[1]] float32 tensor on like's device."""
        buffer = self._by_name.get(name)
        width = like.shape[1]
        if (
            buffer is None
            or buffer.device != like.device
            or buffer.shape[1] != width
            or buffer.shape[0] < num_rows
        ):
            buffer = torch.empty(num_rows, width, dtype=torch.float32, device=like.device)
            self._by_name[name] = buffer
        return buffer[:num_rows]

    def rows(self, name: str, tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``tensor[index]``: ``tensor`` itself when ``index`` is every row, else a buffer."""
        if _is_every_row(index, tensor.shape[0]):
            return tensor
        return torch.index_select(tensor, 0, index, out=self.empty(name, index.numel(), tensor))


@dataclass(slots=True)
class _RowParams:
    """Per-row tensors of the sampled rows: their ids in the logits, temperature, top_k
    (0 = off), top_p, min_p, max logit [n, 1] and uniform number."""

    row_ids: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    row_max: torch.Tensor
    uniform: torch.Tensor

    def select(self, index: torch.Tensor) -> _RowParams:
        return _RowParams(*(getattr(self, f.name)[index] for f in fields(self)))


def _scale_in_place(shifted: torch.Tensor, rows: _RowParams) -> torch.Tensor:
    """``exp(shifted / temperature)``: every path computes the mass with this float32 formula."""
    return shifted.mul_(1.0 / rows.temperature[:, None]).exp_()


def _block_view(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rows`` [n, V] as whole blocks [n, V // block, block] (a view) and the partial tail."""
    num_rows, vocab_size = rows.shape
    tail = rows[:, vocab_size - vocab_size % block_size :] if vocab_size % block_size else None
    if vocab_size < block_size:  # no whole block (unfold refuses a window wider than the row)
        return rows.new_empty(num_rows, 0, block_size), tail
    return rows.unfold(1, block_size, block_size), tail


def _block_sums(mass: torch.Tensor) -> torch.Tensor:
    """Sums over blocks of ``min(DRAW_BLOCK, V)`` tokens, the tail block last: [n, blocks].
    Unlike a whole-row sum, how a block is summed does not depend on the batch size."""
    blocks, tail = _block_view(mass, min(DRAW_BLOCK, mass.shape[1]))
    sums = blocks.sum(dim=-1)
    return sums if tail is None else torch.cat([sums, tail.sum(dim=-1, keepdim=True)], dim=1)


def _block_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Maxima over blocks of ``CANDIDATE_BLOCK`` logits, the tail block last: [n, blocks]."""
    blocks, tail = _block_view(logits, CANDIDATE_BLOCK)
    maxima = blocks.amax(dim=-1)
    return maxima if tail is None else torch.cat([maxima, tail.amax(dim=-1, keepdim=True)], dim=1)


def _draw_whole_rows(mass: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over whole rows of ``mass`` [n, V] in two levels: a block by the cumulative
    block masses, then a token by the cumulative masses inside that block."""
    num_rows, vocab_size = mass.shape
    block_size = min(DRAW_BLOCK, vocab_size)
    block_cdf = torch.cumsum(_block_sums(mass), dim=-1)
    target = _target(block_cdf, uniform)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    mass_before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * block_size + torch.arange(block_size, device=mass.device)
    inside = mass.gather(1, columns.clamp(max=vocab_size - 1))
    inside.masked_fill_(columns >= vocab_size, 0.0)  # past the end of a partial tail block
    position = _position(inside, target - mass_before)
    return (block * block_size + position)[:, 0]


def _draw_candidates(
    values: torch.Tensor, columns: torch.Tensor, threshold: torch.Tensor, rows: _RowParams
) -> torch.Tensor:
    """Inverse CDF over each row's candidates at or above ``threshold``, in vocabulary order.

    The first running mass above the target belongs to a token of positive mass (adding zero
    never moves a sum), and the last running mass is the total, above the target.
    """
    mass = _scale_in_place(values - rows.row_max, rows).mul_(values >= threshold[:, None])
    cdf = torch.cumsum(mass, dim=-1)
    position = torch.searchsorted(cdf, _target(cdf, rows.uniform), right=True)
    return columns.gather(1, position)[:, 0]


def _target(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``uniform * total`` [n, 1], kept strictly below the total whatever the rounding."""
    total = cdf[:, -1:]
    return torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))


def _position(mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose running mass exceeds ``target`` [n, 1], never past the last positive
    mass (a sum and a cumsum of the same numbers can round apart)."""
    position = torch.searchsorted(torch.cumsum(mass, dim=-1), target, right=True)
    offsets = torch.arange(mass.shape[1], device=mass.device)
    last_positive = torch.where(mass > 0, offsets, 0).amax(dim=-1, keepdim=True)
    return torch.minimum(position, last_positive)


def _sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """Each row's values sorted in descending order (values only: the order of ties is moot)."""
    if values.device.type == "cpu":
        # numpy's vectorised sort is an order of magnitude faster than torch's on CPU.
        ascending = np.sort(values.numpy(), axis=-1)
        return torch.from_numpy(ascending[:, ::-1].copy())
    return torch.sort(values, dim=-1, descending=True).values


def _kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k-th largest of ``values`` [n, m]; -inf where k is 0 or exceeds m."""
    width = values.shape[1]
    usable = (k > 0) & (k <= width)
    if not bool(usable.any()):
        return torch.full((values.shape[0],), -math.inf, device=values.device)
    clamped = k.clamp(min=1, max=width)
    best = torch.topk(values, int(clamped[usable].max()), dim=-1).values
    kth = best.gather(1, (clamped.clamp(max=best.shape[1]) - 1)[:, None])[:, 0]
    return torch.where(usable, kth, -math.inf)


def _candidate_groups(
    logits: torch.Tensor,
    selected: torch.Tensor,
    bound: torch.Tensor,
    members: torch.Tensor,
    row_ids: torch.Tensor,
    buffers: _Buffers,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """The logits >= ``bound`` of rows ``row_ids[members]`` of ``logits`` [B, V], packed in
    vocabulary order, as groups of (members, values [rows, C] -inf padded, columns [rows, C],
    False: not whole rows). ``selected`` [rows, blocks] marks the blocks whose maximum reaches
    the bound; only those are read, unless so many are that scanning whole rows is cheaper.
    Rows with at most ``MAX_CANDIDATES`` candidates are packed together, the others apart, so
    one wide row does not widen every row's sort.
    """
    if not members.numel():
        return []
    device = logits.device
    vocab_size = logits.shape[1]
    row_bound = bound[:, None]
    if 4 * int(selected.sum()) > selected.numel():  # dense: scan whole rows
        rows = buffers.rows("gather", logits, row_ids[members])
        flat = (rows >= row_bound).view(-1).nonzero()[:, 0]  # row-major: vocabulary order
        element_rows = flat // vocab_size
        element_columns = flat % vocab_size
        element_values = rows.view(-1)[flat]
    else:  # sparse: only the selected blocks
        block_rows, block_ids = selected.nonzero(as_tuple=True)
        block_columns = block_ids[:, None] * CANDIDATE_BLOCK + torch.arange(
            CANDIDATE_BLOCK, device=device
        )
        in_row = block_columns < vocab_size  # a partial tail block
        flat_source = row_ids[members[block_rows]][:, None] * vocab_size + block_columns
        elements = logits.take(torch.where(in_row, flat_source, 0))
        flat = ((elements >= row_bound[block_rows]) & in_row).view(-1).nonzero()[:, 0]
        element_rows = block_rows[flat // CANDIDATE_BLOCK]
        element_columns = block_columns.view(-1)[flat]
        element_values = elements.view(-1)[flat]
    counts = torch.bincount(element_rows, minlength=members.numel())
    few = counts <= MAX_CANDIDATES
    groups = []
    for in_group in (few, ~few) if not bool(few.all()) else (few,):
        if not bool(in_group.any()):
            continue
        group_counts = counts[in_group]
        if bool(in_group.all()):
            group_rows, group_values, group_columns = element_rows, element_values, element_columns
        else:
            chosen = in_group[element_rows]
            group_rows = (torch.cumsum(in_group, dim=0) - 1)[element_rows[chosen]]
            group_values, group_columns = element_values[chosen], element_columns[chosen]
        row_start = torch.cumsum(group_counts, dim=0) - group_counts
        slot = torch.arange(group_rows.numel(), device=device) - row_start[group_rows]
        # A width in whole vector lengths keeps every row's elementwise math on one code path.
        width = 32 * -(-max(1, int(group_counts.max())) // 32)
        target = group_rows * width + slot
        values = torch.full((group_counts.numel(), width), -math.inf, device=device)
        columns = torch.zeros((group_counts.numel(), width), dtype=torch.int64, device=device)
        values.view(-1)[target] = group_values
        columns.view(-1)[target] = group_columns
        groups.append((members[in_group], values, columns, False))
    return groups


def _thresholds(
    values: torch.Tensor, rows: _RowParams, full_mass: torch.Tensor, complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k / top-p thresholds from each row's candidates, ``values`` [n, C] sorted descending
    and -inf padded: every logit of the row not among them is smaller than all of them (or,
    when ``complete``, they are the whole row).

    Returns (threshold, done); ``done`` is False where the candidates were too few to decide.
    Only values enter (never token ids or the padding width), so neither the order of ties nor
    the rest of the batch can change the answer.
    """
    width = values.shape[1]
    has_k = rows.top_k > 0
    has_p = rows.top_p < 1.0
    k_index = (rows.top_k.clamp(min=1, max=width) - 1)[:, None]
    k_threshold = torch.where(has_k, values.gather(1, k_index)[:, 0], -math.inf)

    mass = _scale_in_place(values - rows.row_max, rows).to(torch.float64)
    if bool(has_k.any()):
        mass.mul_(values >= k_threshold[:, None])  # top-p renormalises over the top-k set
    # float64: a float32 running sum over thousands of tokens would blur the top-p boundary
    cumulative = torch.cumsum(mass, dim=-1)
    total = torch.where(has_k, cumulative[:, -1], full_mass)
    # The first token is always kept; token j > 0 is kept while the mass before it is short.
    short = cumulative[:, :-1] < rows.top_p[:, None] * total[:, None]
    nucleus_size = 1 + short.sum(dim=-1, dtype=torch.int32).to(torch.int64)
    p_threshold = torch.where(has_p, values.gather(1, (nucleus_size - 1)[:, None])[:, 0], -math.inf)
    threshold = torch.maximum(k_threshold, p_threshold)
    if complete:
        return threshold, torch.ones_like(has_k)
    # k candidates exist (the -inf padding says otherwise), and the first logit after the
    # candidates is outside the nucleus iff they already hold enough mass.
    k_known = ~has_k | (k_threshold > -math.inf)
    nucleus_known = ~has_p | (cumulative[:, -1] >= rows.top_p * total)
    return threshold, k_known & nucleus_known


def _is_every_row(index: torch.Tensor, num_rows: int) -> bool:
    return index.numel() == num_rows and bool(
        (index == torch.arange(num_rows, device=index.device)).all()
    )


def _bad_word_bans(info: SamplingInfo) -> list[int]:
    """``bad_word_bans`` over the row's output, a verified row's guesses included."""
    bad_words = info.params.bad_words_token_ids
    if not bad_words:
        return []
    if not info.guessed_ids:
        return bad_word_bans(info.output_ids, bad_words)
    return bad_word_bans(info.output_tail(max(len(word) for word in bad_words)), bad_words)
