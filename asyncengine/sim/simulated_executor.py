"""SimulatedExecutor: a cost model in place of the model, on a virtual clock.

Every sampled segment gets the same non-EOS token, and each plan advances the clock by the cost
model's estimate of its forward time. KV memory is only accounted for, never allocated.

Speculative decoding: a verified row's guesses cost what extend tokens cost (the fitted
per-token and attention terms: verifying is an extend over the paged KV), and each guess of a
request is accepted with its ``acceptance`` (from the workload; 0 when unknown) until the first
rejection, drawn from a seeded generator, so a rule that guesses where guesses fail pays for it.

LoRA: with ``lora`` set, each step also pays its adapters' compute; their read back into
memory holds their requests before the queue, not the step (sim/lora_cost.py).
"""

from __future__ import annotations

import operator
import random

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, StepOutput, TokenLogprobs
from asyncengine.core.executor_api import KVLayout, ModelSpec
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel
from asyncengine.sim.lora_cost import LoraCharges

# The embedded default model (SmolLM2-135M): its context, vocabulary and the bytes of K+V per
# token (30 layers x 3 kv heads x 64 dims x 2 tensors x 2 bytes bf16), to turn kv_cache_bytes
# into tokens as the real engine would.
DEFAULT_SPEC = ModelSpec(
    max_model_len=8192, vocab_size=49152, eos_token_ids=(0,), kv_bytes_per_token=30 * 3 * 64 * 2 * 2
)
# bytes of one K or V value by kv_cache_dtype ("auto": the default model's bfloat16); an int8 or
# fp8 row also carries a 2-byte scale per token and head (kernels/reference/kv_int8_ref.py)
KV_VALUE_BYTES = {"auto": 2, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
INT8_SCALE_BYTES = 2


def default_kv_bytes_per_token(kv_cache_dtype: str) -> int:
    """K + V bytes of one token of the default model in a pool of ``kv_cache_dtype``."""
    layers, kv_heads, head_dim = 30, 3, 64
    row = head_dim * KV_VALUE_BYTES[kv_cache_dtype]
    if kv_cache_dtype in ("int8", "fp8"):
        row += INT8_SCALE_BYTES
    return 2 * layers * kv_heads * row


_start_pos = operator.attrgetter("start_pos")

# Bytes per second a swap copies between the KV pool and the host buffer: scripts/micro/bench_swap.py
# on the 2-core development CPU with the native page-run copy (0.8-1.1 GB/s each way for 64-
# and 256-page victims, under a load average of 8), as the default cost model is that CPU's.
# A GPU's pinned PCIe copies are far faster. A swap costs its bytes over this, added to the
# step's forward time.
DEFAULT_SWAP_BYTES_PER_SECOND = 0.9e9
# every token a simulated step samples, unless the executor is given another
SAMPLED_TOKEN_ID = 1


class SimulatedExecutor:
    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        spec: ModelSpec = DEFAULT_SPEC,
        sampled_token_id: int = SAMPLED_TOKEN_ID,
        swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND,
    ) -> None:
        if swap_bytes_per_second <= 0:
            raise ValueError("swap_bytes_per_second must be > 0")
        self.swap_bytes_per_second = swap_bytes_per_second
        if sampled_token_id in spec.eos_token_ids:
            raise ValueError("the simulated token must not be an EOS token")
        self.cost_model = cost_model
        self.clock = clock
        self.spec = spec
        self.sampled_token_id = sampled_token_id
        self.layout: KVLayout | None = None
        self.acceptance: dict[str, float] = {}  # rid -> chance each guess is accepted
        self._draws = random.Random(0)
        self.lora: LoraCharges | None = None  # what the requests' adapters cost (None: none)

    def kv_budget_bytes(self, config: EngineConfig) -> int | None:
        return None

    def bind(self, layout: KVLayout) -> None:
        self.layout = layout

    def seconds(self, plan: BatchPlan) -> float:
        """The cost model's forward time for ``plan``."""
        decodes = plan.decodes
        # a decode attends to its start_pos + 1 keys
        return self.bulk_seconds(plan, len(decodes), sum(map(_start_pos, decodes)))

    def bulk_seconds(self, plan: BatchPlan, num_decodes: int, sum_start_pos: int) -> float:
        """The forward time of ``plan`` with ``num_decodes`` decodes whose start positions sum
        to ``sum_start_pos`` (``plan.decodes`` are those decodes, or are counted elsewhere:
        sim/bulk_decode.py); their verified guesses are in ``plan.decodes``."""
        prefill_tokens = prefill_attention = 0
        for seg in plan.extends:
            n = len(seg.input_ids)
            prefill_tokens += n
            prefill_attention += n * seg.start_pos + n * (n + 1) // 2
        decode_context = sum_start_pos + num_decodes
        if plan.num_guesses:  # verified guesses: extend tokens after the decode's position
            for seg in plan.decodes:
                g = seg.guesses
                prefill_tokens += g
                prefill_attention += g * (seg.start_pos + 1) + g * (g + 1) // 2
        return self.cost_model.seconds(
            prefill_tokens, prefill_attention, num_decodes, decode_context
        )

    def swap_seconds(self, plan: BatchPlan) -> float:
        """The time ``plan``'s swap copies take: their bytes over the copy bandwidth."""
        if not plan.swap_out and not plan.swap_in:
            return 0.0
        assert self.layout is not None
        pages = sum(len(c.pool_pages) for c in plan.swap_out) + sum(
            len(c.pool_pages) for c in plan.swap_in
        )
        page_bytes = self.layout.page_size * self.spec.kv_bytes_per_token
        return pages * page_bytes / self.swap_bytes_per_second

    def execute(self, plan: BatchPlan) -> StepOutput:
        swap = self.swap_seconds(plan)
        seconds = self.seconds(plan) + swap
        if self.lora is not None:
            seconds += self.lora.step_seconds(plan)
        self.clock.advance(seconds)
        n = len(plan.sampling)
        # embeddings and prompt scoring cost time and carry nothing
        pooled = [[0.0] for _ in plan.pooled_segments]
        scored = [
            [TokenLogprobs(0.0, []) for _ in seg.scoring.target_ids]
            for seg in plan.scoring_segments
            if seg.scoring is not None
        ]
        output = StepOutput(
            [self.sampled_token_id] * n,
            [None] * n,
            forward_seconds=seconds,
            swap_seconds=swap,
            pooled=pooled,
            prompt_logprobs=scored,
        )
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
