"""Closed-loop chat on the real engine: each conversation's next turn is sent only when its
previous turn has finished, and its prompt is that turn's prompt + the engine's own answer (its
token ids) + the next user message, as a chat client sends it back.

A trace replayed open loop carries the trace's answers, which the engine never gave, so those
tokens can never be cached; here every token of a conversation's history is one the engine has
seen. The conversations come from a workload (``multi_turn``, or any trace where a turn's
prompt starts with the previous turn's prompt): ``conversations_of`` reads them back out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from asyncengine.bench.records import RequestRecord
from asyncengine.common.config import EngineConfig
from asyncengine.common.outputs import GenerateOutput
from asyncengine.sim.engine_replay import record_of, warm_up
from asyncengine.sim.workload_replay import params_for
from asyncengine.workloads.trace import WorkloadRequest


@dataclass(slots=True)
class Conversation:
    """One chat session: its turns in order; turn 0's prompt whole, each later turn's prompt
    only for its length and new user message (``messages[k]``: what turn k adds after the
    previous turn's answer)."""

    turns: list[WorkloadRequest]
    messages: list[list[int]]

    @property
    def final_context(self) -> int:
        """Tokens of the whole conversation: its last prompt and last answer."""
        return len(self.turns[-1].prompt_ids) + self.turns[-1].output_len


def conversations_of(workload: Sequence[WorkloadRequest]) -> list[Conversation]:
    """The chat sessions of ``workload``: a request continues the earlier request whose prompt
    is the longest prefix of its own and leaves room for that request's answer; what follows
    that answer is its new user message. A request that continues none starts a conversation."""
    ordered = sorted(workload, key=lambda w: w.arrival_time)
    conversations: list[Conversation] = []
    owner: dict[str, tuple[int, int]] = {}  # rid -> (conversation, its turn)
    last_turn: dict[int, str] = {}  # conversation -> rid of its latest turn
    for item in ordered:
        parent: WorkloadRequest | None = None
        for index, rid in last_turn.items():
            earlier = conversations[index].turns[owner[rid][1]]
            head = earlier.prompt_ids
            if (
                len(head) + earlier.output_len < len(item.prompt_ids)
                and item.prompt_ids[: len(head)] == head
                and (parent is None or len(head) > len(parent.prompt_ids))
            ):
                parent = earlier
        if parent is None:
            owner[item.rid] = (len(conversations), 0)
            last_turn[len(conversations)] = item.rid
            conversations.append(Conversation([item], [list(item.prompt_ids)]))
            continue
        index = owner[parent.rid][0]
        conversation = conversations[index]
        owner[item.rid] = (index, len(conversation.turns))
        last_turn[index] = item.rid
        conversation.messages.append(
            list(item.prompt_ids[len(parent.prompt_ids) + parent.output_len :])
        )
        conversation.turns.append(item)
    return conversations


@dataclass(slots=True)
class ClosedLoopRun:
    """What a closed-loop run sent and got, by request id: ``prompts`` (as sent) and
    ``outputs`` (the engine's answers, token ids), plus the records and the engine's stats."""

    records: list[RequestRecord]
    stats: dict[str, object]
    prompts: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)


async def replay_closed_loop(
    config: EngineConfig,
    conversations: Sequence[Conversation],
    concurrency: int,
    think_time: float = 0.0,
    warmup_requests: int = 1,
) -> ClosedLoopRun:
    """Run ``conversations`` on an ``AsyncEngine(config)``, ``concurrency`` turns in flight
    (each of a different conversation), greedy with each turn's ``output_len`` tokens.

    A conversation whose turn finished is ready for its next turn ``think_time`` seconds later;
    a free client takes the conversation ready longest (first turns in workload order), so with
    fewer clients than conversations every conversation waits its round, as chat users do.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    if think_time < 0:
        raise ValueError(f"think_time must be >= 0, not {think_time}")
    from asyncengine.api.engine import AsyncEngine

    firsts = [c.turns[0] for c in conversations]
    async with AsyncEngine(config) as engine:
        await warm_up(engine, firsts, warmup_requests)
        loop = asyncio.get_running_loop()
        start = loop.time()
        run = ClosedLoopRun([], {})
        ready: asyncio.Queue[int | None] = asyncio.Queue()
        for index in range(len(conversations)):
            ready.put_nowait(index)
        histories: list[list[int]] = [[] for _ in conversations]
        next_turn = [0] * len(conversations)
        remaining = sum(len(c.turns) for c in conversations)
        clients = min(concurrency, len(conversations))

        def done_turn(index: int, dropped: int) -> None:
            """A turn of conversation ``index`` ended, and ``dropped`` of its turns will not run."""
            nonlocal remaining
            remaining -= 1 + dropped
            if next_turn[index] < len(conversations[index].turns):
                if think_time > 0:
                    loop.call_later(think_time, ready.put_nowait, index)
                else:
                    ready.put_nowait(index)
            if remaining == 0:
                for _ in range(clients):
                    ready.put_nowait(None)

        async def client() -> None:
            while (index := await ready.get()) is not None:
                conversation, turn = conversations[index], next_turn[index]
                item = conversation.turns[turn]
                prompt = histories[index] + conversation.messages[turn]
                arrival = loop.time() - start
                outs: list[GenerateOutput | None]
                try:
                    given = await engine.generate_choices(
                        prompt, params_for(item), request_id=item.rid
                    )
                    outs = list(given)
                except Exception:  # counted as failed; the run goes on
                    outs = [None] * item.n
                sent = replace(item, arrival_time=arrival, prompt_ids=prompt)
                now = loop.time() - start
                for rid, got in zip(sent.choice_rids, outs, strict=True):
                    run.records.append(record_of(sent, arrival, got, now, rid))
                run.prompts[item.rid] = prompt
                out = outs[0]  # the conversation goes on from choice 0's answer
                dropped = 0
                if out is None or out.finish_reason in ("abort", "timeout"):
                    dropped = len(conversation.turns) - turn - 1  # a failed turn ends its chat
                    next_turn[index] = len(conversation.turns)
                else:
                    run.outputs[item.rid] = list(out.token_ids)
                    histories[index] = prompt + list(out.token_ids)
                    next_turn[index] = turn + 1
                done_turn(index, dropped)

        await asyncio.gather(*(client() for _ in range(clients)))
        run.records.sort(key=lambda r: r.arrival_time)
        run.stats = dict(engine.stats())
    return run


def outputs_agree(runs: Sequence[dict[str, list[int]]]) -> str:
    """``identical (N answers)`` when every run gave every request the same tokens, else
    which requests differ: in a closed loop one different answer changes every later prompt
    of its conversation, so a tier that keeps outputs identical keeps the whole run identical."""
    if not runs:
        return "identical (0 answers)"
    first = runs[0]
    differ = sorted(
        {
            rid
            for run in runs[1:]
            for rid in first.keys() | run.keys()
            if run.get(rid) != first.get(rid)
        }
    )
    if not differ:
        return f"identical ({len(first)} answers)"
    return f"DIFFER in {len(differ)} of {len(first)} answers (first: {differ[0]})"
