"""Policy experiments at scale: the real engine core driven on a virtual clock, by a cost model
(the simulator) or by measured forwards of the real model (sim_vs_real)."""

from __future__ import annotations

from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.cost_model import CostModel, StepFeatures
from asyncengine.sim.simulated_executor import SimulatedExecutor
from asyncengine.sim.simulator import SimResult, Simulator, simulate
from asyncengine.sim.timed_executor import TimedExecutor
from asyncengine.sim.workload_replay import WorkloadReplay

__all__ = [
    "CostModel",
    "SimResult",
    "SimulatedExecutor",
    "Simulator",
    "StepFeatures",
    "TimedExecutor",
    "VirtualClock",
    "WorkloadReplay",
    "simulate",
]
