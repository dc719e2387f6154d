"""Prompt logprobs: the final hidden states at a plan's scored positions into the logprob of
each next prompt token, its rank and the top-k alternatives (``PromptScoring``,
asyncengine/common/plan.py).

Logits are vocabulary-wide, so they are made ``chunk_rows`` positions at a time: a long prompt
never holds a [prompt, vocab] tensor, only a [chunk_rows, vocab] one, and it is gone before the
next chunk. A logprob is its logit less the row's log-sum-exp (kernels/cpu/logprobs_native.py: no
log_softmax tensor is written), the token's and the top values alike, so a prompt token that is
the most likely one has a logprob equal to the top value, exactly (what lm-evaluation-harness
reads as "greedy").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncengine.common.plan import PromptScoring, TokenLogprobs
from asyncengine.kernels.cpu.logprobs_native import row_max_lse

SCORE_CHUNK_ROWS = 256  # positions whose logits exist at once: 256 x 49152 float32 is 48 MiB


def score_prompt_positions(
    hidden: torch.Tensor,
    scorings: list[PromptScoring],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    chunk_rows: int = SCORE_CHUNK_ROWS,
    rows: torch.Tensor | None = None,
) -> list[list[TokenLogprobs]]:
    """``hidden`` [rows, H]: the final hidden states of the scorings' positions; ``rows``
    [positions] the row each scored position reads, in order (None: a row each, in order), so
    positions with the same hidden state (a lead: PromptScoring.lead) share one row of logits;
    ``compute_logits`` makes float32 logits of some of those rows. One list per scoring."""
    return logits_and_scores(hidden, 0, scorings, compute_logits, chunk_rows, rows).scores


@dataclass(slots=True)
class LogitsAndScores:
    logits: torch.Tensor  # [sampled rows, vocab] float32
    scores: list[list[TokenLogprobs]]  # one list per scoring


def logits_and_scores(
    hidden: torch.Tensor,
    num_sampled: int,
    scorings: list[PromptScoring],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    chunk_rows: int = SCORE_CHUNK_ROWS,
    rows: torch.Tensor | None = None,
) -> LogitsAndScores:
    """``score_prompt_positions`` over ``hidden[num_sampled:]``, whose first ``num_sampled`` rows
    (the step's sampled rows) have their logits returned instead: the LM head's product over
    every row of a step at once. A step of lm-eval's has ~16 sampled and ~40 scored rows; two
    products of those sizes cost ~1.5x one of all (the head's weight is read once, and
    the smaller one fell below the dense crossover: linear.py)."""
    vocab = None
    sampled: list[torch.Tensor] = []
    targets = torch.tensor(
        [t for s in scorings for t in s.target_ids], dtype=torch.int64, device=hidden.device
    )
    top_k = [s.top_k for s in scorings for _ in s.target_ids]
    if rows is None:
        rows = torch.arange(len(top_k), device=hidden.device)
    rows = rows + num_sampled  # rows of ``hidden``
    chosen = torch.empty(len(top_k), dtype=torch.float32, device=hidden.device)
    ranks = torch.empty(len(top_k), dtype=torch.int64, device=hidden.device)
    tops: list[list[tuple[int, float]]] = [[] for _ in top_k]
    for begin in range(0, hidden.shape[0], chunk_rows):
        end = min(begin + chunk_rows, hidden.shape[0])
        logits = compute_logits(hidden[begin:end])
        vocab = logits.shape[1]
        first_scored = max(begin, min(end, num_sampled))  # the chunk's first row to score
        if first_scored > begin:
            sampled.append(logits[: first_scored - begin].clone())
        if first_scored == end:
            continue
        scored = logits[first_scored - begin :]
        rows_lse = row_max_lse(scored)  # a logprob is the logit less its row's log-sum-exp
        at = torch.nonzero((rows >= first_scored) & (rows < end)).flatten()  # positions read
        local = rows[at] - first_scored
        target_logits = scored[local, targets[at]]
        chosen[at] = target_logits - rows_lse.lse[local]
        # vLLM's rank: the tokens at least as likely, the token itself among them
        ranks[at] = (scored[local] >= target_logits[:, None]).sum(dim=-1)
        positions = at.tolist()
        most = min(max((top_k[i] for i in positions), default=0), scored.shape[1])
        if most == 0:
            continue
        if most == 1:  # the row's max, already found
            best_ids = rows_lse.argmax[local, None]
            best_values = (rows_lse.max - rows_lse.lse)[local, None]
        else:
            best = torch.topk(scored, most, dim=-1)
            best_ids = best.indices[local]
            best_values = (best.values - rows_lse.lse[:, None])[local]
        for i, ids, values in zip(positions, best_ids.tolist(), best_values.tolist(), strict=True):
            tops[i] = list(zip(ids[: top_k[i]], values[: top_k[i]], strict=True))
    values, rank_of = chosen.tolist(), ranks.tolist()
    out: list[list[TokenLogprobs]] = []
    at_position = 0
    for scoring in scorings:
        n = scoring.num_positions
        out.append(
            [
                TokenLogprobs(values[i], tops[i], rank_of[i])
                for i in range(at_position, at_position + n)
            ]
        )
        at_position += n
    if sampled:
        logits = torch.cat(sampled) if len(sampled) > 1 else sampled[0]
    else:
        logits = hidden.new_empty((0, vocab or 0), dtype=torch.float32)
    return LogitsAndScores(logits, out)
