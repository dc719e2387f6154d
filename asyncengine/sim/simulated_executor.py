"""SimulatedExecutor: a cost model in place of the model, on a virtual clock.

Every sampled segment gets the same non-EOS token, and each plan advances the clock by the cost
model's estimate of its forward time. KV memory is only accounted for, never allocated.

Speculative decoding: a verified row's guesses cost what extend tokens cost (the fitted
per-token and attention terms: verifying is an extend over the paged KV), and each guess of a
request is accepted with its ``acceptance`` (from the workload; 0 when unknown) until the first
rejection, drawn from a seeded generator, so a rule that guesses where guesses fail pays for it.
"""

from __future__ import annotations

import operator
import random

from asyncengine.config import EngineConfig
from asyncengine.executor_api import KVLayout, ModelSpec
from asyncengine.plan import BatchPlan, StepOutput
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel

# The embedded default model (SmolLM2-135M): its context, vocabulary and the bytes of K+V per
# token (30 layers x 3 kv heads x 64 dims x 2 tensors x 2 bytes bf16), to turn kv_cache_bytes
# into tokens as the real engine would.
DEFAULT_SPEC = ModelSpec(
    max_model_len=8192, vocab_size=49152, eos_token_ids=(0,), kv_bytes_per_token=30 * 3 * 64 * 2 * 2
)

_start_pos = operator.attrgetter("start_pos")


class SimulatedExecutor:
    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        spec: ModelSpec = DEFAULT_SPEC,
        sampled_token_id: int = 1,
    ) -> None:
        if sampled_token_id in spec.eos_token_ids:
            raise ValueError("the simulated token must not be an EOS token")
        self.cost_model = cost_model
        self.clock = clock
        self.spec = spec
        self.sampled_token_id = sampled_token_id
        self.layout: KVLayout | None = None
        self.acceptance: dict[str, float] = {}  # rid -> chance each guess is accepted
        self._draws = random.Random(0)

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        self.layout = layout

    def seconds(self, plan: BatchPlan) -> float:
        """The cost model's forward time for ``plan``."""
        prefill_tokens = prefill_attention = 0
        for seg in plan.extends:
            n = len(seg.input_ids)
            prefill_tokens += n
            prefill_attention += n * seg.start_pos + n * (n + 1) // 2
        decodes = plan.decodes
        # a decode attends to its start_pos + 1 keys
        decode_context = sum(map(_start_pos, decodes)) + len(decodes)
        if plan.num_guesses:  # verified guesses: extend tokens after the decode's position
            for seg in decodes:
                g = seg.guesses
                prefill_tokens += g
                prefill_attention += g * (seg.start_pos + 1) + g * (g + 1) // 2
        return self.cost_model.seconds(
            prefill_tokens, prefill_attention, len(decodes), decode_context
        )

    def execute(self, plan: BatchPlan) -> StepOutput:
        seconds = self.seconds(plan)
        self.clock.advance(seconds)
        n = len(plan.sampling)
        output = StepOutput([self.sampled_token_id] * n, [None] * n, forward_seconds=seconds)
        if plan.num_guesses:
            output.accepted = [
                self._accepted(seg.rid, seg.guesses) for seg in plan.segments if seg.sample
            ]
        return output

    def _accepted(self, rid: str, guesses: int) -> int:
        """How many of ``guesses`` a request with its acceptance keeps (until one fails)."""
        chance = self.acceptance.get(rid, 0.0)
        kept = 0
        while kept < guesses and self._draws.random() < chance:
            kept += 1
        return kept
