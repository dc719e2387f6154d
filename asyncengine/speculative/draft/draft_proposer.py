"""DraftProposer: speculative decoding's guesses from a smaller model of the same tokenizer.

The executor runs it inside a step whose plan has drafted rows (``Segment.draft``), around the
target's verify forward:

1. rows the KV manager released since the previous plan (``BatchPlan.released_rows``: their
   requests finished, were aborted or retracted) drop their draft KV;
2. ``propose``: each drafted row catches up on the tokens its draft KV has not seen (the whole
   prompt at its first proposal, then the tokens accepted since) and guesses one token, all rows
   in one forward; then one forward per further guess, for every row still guessing. Guesses
   are the draft's argmax (a point mass: the verify rule in speculative/acceptance.py is then
   exact for sampled rows too);
3. the target verifies the guesses (the runner's verify path, unchanged);
4. ``settle``: the draft KV of the rejected guesses is truncated.

Its pages are accounted by a ``KVCacheManager`` of their own, without a prefix cache (one
sequence per target row, no sharing), over a pool of the draft's shape with as many token slots
as the target's. A row the draft pool (or the draft's context) has no room for is verified
without guesses this step. The draft forwards run through a ``ModelRunner`` of the draft's on
the same device, dtype, attention backend and deterministic mode as the target's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from asyncengine.cache.allocator import OutOfPagesError
from asyncengine.cache.manager import KVCacheManager, SeqKV
from asyncengine.common.joined_ids import JoinedIds
from asyncengine.common.plan import BatchPlan, Segment, StepOutput
from asyncengine.executor.runner import ModelRunner


@dataclass(slots=True)
class _DraftSeq:
    """The draft KV of one target row: whose it is, and its pages (``seq.kv_len`` tokens of the
    request's, from position 0, have their draft KV written)."""

    rid: str
    seq: SeqKV


@dataclass(slots=True)
class _Guessing:
    """One drafted row during ``propose``."""

    state: _DraftSeq
    entry: int  # its index among the plan's sampled segments
    tokens: JoinedIds  # the request's tokens: prompt, then output so far
    wanted: int  # guesses to make
    guesses: list[int]


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, target_vocab_size: int) -> None:
        """``runner``: the draft model's, over its own pool and page table; ``kv``: the
        accounting of that pool's pages (no prefix cache); guesses are taken among the first
        ``target_vocab_size`` token ids."""
        if kv.enable_prefix_cache:
            raise ValueError("the draft's KV is per row: its manager has no prefix cache")
        self.runner = runner
        self.kv = kv
        self.vocab_size = min(target_vocab_size, runner.config.vocab_size)
        self.max_model_len = runner.config.max_model_len
        self._rows: dict[int, _DraftSeq] = {}  # target page-table row -> its draft KV
        self._forwards = 0

    def held_rows(self) -> dict[int, str]:
        """The target rows that hold draft KV, and whose it is (row -> request id)."""
        return {row: state.rid for row, state in self._rows.items()}

    def release(self, rows: list[int]) -> None:
        """Free the draft KV of target rows whose sequences ended."""
        for row in rows:
            state = self._rows.pop(row, None)
            if state is not None:
                self.kv.close(state.seq, cache=False)

    def execute(self, plan: BatchPlan, verify: Callable[[BatchPlan], StepOutput]) -> StepOutput:
        """The step: release, guess, have ``verify`` (the target runner's execute) run the plan
        with the guesses in place, settle the draft KV; the output says what was guessed."""
        self.release(plan.released_rows)
        if not plan.num_drafts:
            return verify(plan)
        start = time.perf_counter()
        guessing = self.propose(plan)
        output = verify(_with_guesses(plan, guessing))
        self.settle(guessing, output)
        drafted: list[list[int]] = [[] for _ in plan.sampling]
        for row in guessing:
            drafted[row.entry] = row.guesses
        output.drafted = drafted
        output.forward_seconds = time.perf_counter() - start  # the draft's forwards count too
        return output

    def propose(self, plan: BatchPlan) -> list[_Guessing]:
        """Guesses for each drafted row of ``plan`` (greedy; as many as the row's ``draft``
        where the draft has room)."""
        guessing: list[_Guessing] = []
        sampled = [seg for seg in plan.segments if seg.sample]
        for entry, (seg, info) in enumerate(zip(sampled, plan.sampling, strict=True)):
            if not seg.draft:
                continue
            # read in place: a step reads the tokens the draft has not seen, not the context
            tokens = JoinedIds(info.prompt_ids, info.output_ids)
            if tokens[-1] != seg.input_ids[0] or len(tokens) != seg.start_pos + 1:
                raise ValueError(f"drafted row {seg.rid!r}: its tokens do not end at its segment")
            # the last guess is not fed back: the draft writes positions up to len + wanted - 2
            wanted = min(seg.draft, self.max_model_len - len(tokens) + 1)
            if wanted > 0:
                state = self._state(seg)
                guessing.append(_Guessing(state, entry, tokens, wanted, []))
        # first forward: every row's unseen tokens, its first guess after them
        first: list[tuple[_Guessing, Segment]] = []
        for row in guessing:
            seq = row.state.seq
            unseen = row.tokens[seq.kv_len :]
            if not self._extend(seq, len(unseen)):
                continue
            first.append(
                (row, Segment(row.state.rid, seq.row, unseen, seq.kv_len - len(unseen), True))
            )
        active = self._guess(first)
        # then one forward per further guess, for the rows still guessing
        while active:
            step: list[tuple[_Guessing, Segment]] = []
            for row in active:
                if len(row.guesses) >= row.wanted:
                    continue
                seq = row.state.seq
                if not self._extend(seq, 1):
                    continue
                step.append(
                    (row, Segment(row.state.rid, seq.row, row.guesses[-1:], seq.kv_len - 1, True))
                )
            active = self._guess(step)
        return guessing

    def settle(self, guessing: list[_Guessing], output: StepOutput) -> None:
        """Keep the draft KV of the tokens the target accepted: a row that guessed g tokens
        wrote the draft KV of its first g - 1, of which those accepted stay."""
        for row in guessing:
            if not row.guesses:
                continue
            accepted = output.accepted[row.entry] if output.accepted else 0
            keep = len(row.tokens) + min(accepted, len(row.guesses) - 1)
            self.kv.truncate(row.state.seq, min(keep, row.state.seq.kv_len))

    def _state(self, seg: Segment) -> _DraftSeq:
        """The draft KV of ``seg``'s row, fresh if the row is new to the draft or now another
        request's."""
        state = self._rows.get(seg.row)
        if state is not None and (state.rid != seg.rid or state.seq.kv_len > seg.start_pos):
            self.release([seg.row])
            state = None
        if state is None:
            state = _DraftSeq(seg.rid, self.kv.open([]))
            self._rows[seg.row] = state
        return state

    def _extend(self, seq: SeqKV, num_tokens: int) -> bool:
        """Draft KV slots for ``num_tokens`` more tokens; False when the draft pool is full."""
        try:
            self.kv.extend(seq, num_tokens)
        except OutOfPagesError:
            return False
        return True

    def _guess(self, rows: list[tuple[_Guessing, Segment]]) -> list[_Guessing]:
        """One draft forward over ``rows``' segments; each row's next guess is the argmax after
        its segment. Returns the rows."""
        if not rows:
            return []
        self._forwards += 1
        extends = [(row, seg) for row, seg in rows if seg.num_tokens > 1]
        decodes = [(row, seg) for row, seg in rows if seg.num_tokens == 1]
        plan = BatchPlan(
            step=self._forwards,
            extends=[seg for _, seg in extends],
            decodes=[seg for _, seg in decodes],
            page_writes=self.kv.page_table.drain_writes(),
        )
        logits = self.runner.forward_logits(plan)[:, : self.vocab_size]
        guesses = torch.argmax(logits, dim=-1).tolist()
        ordered = [row for row, _ in extends] + [row for row, _ in decodes]
        for row, guess in zip(ordered, guesses, strict=True):
            row.guesses.append(int(guess))
        return ordered


def _with_guesses(plan: BatchPlan, guessing: list[_Guessing]) -> BatchPlan:
    """``plan`` with each drafted row's guesses as its verified input (``Segment.guesses``);
    a row without guesses decodes its one token."""
    by_entry = {row.entry: row.guesses for row in guessing}
    first_decode = sum(1 for seg in plan.extends if seg.sample)  # decodes are sampled last
    decodes = []
    for entry, seg in enumerate(plan.decodes, first_decode):
        if seg.draft:
            guesses = by_entry.get(entry, [])
            seg = Segment(
                seg.rid,
                seg.row,
                [*seg.input_ids, *guesses],
                seg.start_pos,
                True,
                guesses=len(guesses),
                lora=seg.lora,  # verified under the request's adapter (the draft guesses bare)
            )
        decodes.append(seg)
    return replace(plan, decodes=decodes)
