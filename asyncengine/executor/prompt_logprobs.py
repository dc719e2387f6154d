"""Prompt logprobs: the final hidden states at a plan's scored positions into the logprob of
each next prompt token and the top-k alternatives (``PromptScoring``, asyncengine/plan.py).

Logits are vocabulary-wide, so they are made ``chunk_rows`` positions at a time: a long prompt
never holds a [prompt, vocab] tensor, only a [chunk_rows, vocab] one, and it is gone before the
next chunk. The token's logprob and the top values come out of the same ``log_softmax``, so a
prompt token that is the most likely one has a logprob equal to the top value, exactly (what
lm-evaluation-harness reads as "greedy").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncengine.plan import PromptScoring, TokenLogprobs

SCORE_CHUNK_ROWS = 256  # positions whose logits exist at once: 256 x 49152 float32 is 48 MiB


def score_prompt_positions(
    hidden: torch.Tensor,
    scorings: list[PromptScoring],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    chunk_rows: int = SCORE_CHUNK_ROWS,
) -> list[list[TokenLogprobs]]:
    """``hidden`` [rows, H]: the final hidden states of every scoring's positions, in order;
    ``compute_logits`` makes float32 logits of some of those rows. One list per scoring."""
    targets = torch.tensor(
        [t for s in scorings for t in s.target_ids], dtype=torch.int64, device=hidden.device
    )
    top_k = [s.top_k for s in scorings for _ in s.target_ids]
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for begin in range(0, hidden.shape[0], chunk_rows):
        end = min(begin + chunk_rows, hidden.shape[0])
        logprobs = torch.log_softmax(compute_logits(hidden[begin:end]), dim=-1)
        chosen += logprobs.gather(1, targets[begin:end, None])[:, 0].tolist()
        most = min(max(top_k[begin:end]), logprobs.shape[1])
        if most == 0:
            tops += [[] for _ in range(end - begin)]
            continue
        best = torch.topk(logprobs, most, dim=-1)
        for ids, values, k in zip(
            best.indices.tolist(), best.values.tolist(), top_k[begin:end], strict=True
        ):
            tops.append(list(zip(ids[:k], values[:k], strict=True)))
    out: list[list[TokenLogprobs]] = []
    at = 0
    for scoring in scorings:
        n = scoring.num_positions
        out.append([TokenLogprobs(chosen[i], tops[i]) for i in range(at, at + n)])
        at += n
    return out
