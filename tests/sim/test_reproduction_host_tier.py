"""The host-tier reproduction (vLLM's CPU KV offloading): with the tier, the later turns of a
multi-turn chat bigger than the pool come back from host memory, on a short simulated run."""

from __future__ import annotations

from asyncengine.sim.reproductions import REPRODUCTIONS
from asyncengine.sim.reproductions.host_tier import HostTier


def test_the_host_tier_serves_later_turns_from_host_memory() -> None:
    assert isinstance(REPRODUCTIONS["host-tier"], HostTier)
    small = HostTier()
    small.sim_setting = (
        dict(num_conversations=8, num_turns=3, system_len=128, user_median=128.0), 1024, 0.3
    )  # fmt: skip
    outcome = small.run(real=False)
    plain, tiered = outcome.numbers["pool only"], outcome.numbers["host tier"]
    assert plain["host_hit_tokens"] == 0 and plain["tier_in_bytes"] == 0
    assert tiered["host_hit_tokens"] > 0 and tiered["tier_in_bytes"] > 0
    assert tiered["hit_rate"] > plain["hit_rate"]
    assert outcome.numbers["later_turns_ttft_gain"] > 1.0
    assert "TTFT p50 turns 2+" in outcome.table
