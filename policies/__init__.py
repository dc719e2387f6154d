"""Scheduling policies: order the waiting queue and budget each step. One small file each."""

from asyncengine.policies.base import Policy, PolicyContext, StepBudget
from asyncengine.policies.registry import BUILTIN, ComposedPolicy, make_policy

__all__ = ["BUILTIN", "ComposedPolicy", "Policy", "PolicyContext", "StepBudget", "make_policy"]
