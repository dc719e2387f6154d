"""Policy experiments at scale: the real scheduler driven by a cost model on a virtual clock."""

from __future__ import annotations

from asyncengine.sim.cost_model import CostModel, StepFeatures
from asyncengine.sim.simulator import SimResult, Simulator, VirtualClock, simulate

__all__ = ["CostModel", "SimResult", "Simulator", "StepFeatures", "VirtualClock", "simulate"]
