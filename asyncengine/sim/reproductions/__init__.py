"""Published scheduling results reproduced on our engine: one module per result, by name.

    from asyncengine.sim.reproductions import REPRODUCTIONS
    outcome = REPRODUCTIONS["vtc"].run(real=False)

``scripts/reproduce.py NAME [--real]`` runs one and writes its section of
docs/REPRODUCTIONS.md (document.py). A new reproduction is a class with ``name``, ``title``,
``claim`` and ``run(real) -> Outcome`` (base.py), registered here.
"""

from __future__ import annotations

from asyncengine.sim.reproductions.base import Claim, Outcome, Reproduction, run_workload
from asyncengine.sim.reproductions.chunked_prefill import ChunkedPrefillTradeoff
from asyncengine.sim.reproductions.hol_skip import HeadOfLineSkip
from asyncengine.sim.reproductions.host_tier import HostTier
from asyncengine.sim.reproductions.recompute_tax import RecomputeTax
from asyncengine.sim.reproductions.vtc import VTCFairness

REPRODUCTIONS: dict[str, Reproduction] = {
    r.name: r
    for r in (
        VTCFairness(),
        HeadOfLineSkip(),
        ChunkedPrefillTradeoff(),
        RecomputeTax(),
        HostTier(),
    )
}


def register(reproduction: Reproduction) -> None:
    """Add a reproduction (a name already taken is an error)."""
    if reproduction.name in REPRODUCTIONS:
        raise ValueError(f"a reproduction named {reproduction.name!r} is already registered")
    REPRODUCTIONS[reproduction.name] = reproduction


__all__ = ["REPRODUCTIONS", "Claim", "Outcome", "Reproduction", "register", "run_workload"]
