"""A policy that defines ``order`` or ``budget`` and sets no ``orders``/``budgets`` flag still
has its hook used inside a composition (``mine+token-budget``), as it is used alone."""

from __future__ import annotations

from asyncengine.common.config import EngineConfig
from asyncengine.common.request import Request
from asyncengine.policies import PolicyContext, make_policy
from asyncengine.policies.base import Policy, StepBudget
from tests.policies.test_policies import assert_starts_shortest_first, ctx

HERE = "tests.policies.test_hook_flags"


class ShortestNoFlag(Policy):
    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return sorted(waiting, key=lambda r: len(r.prompt_ids))


class SmallBudgetNoFlag(Policy):
    def budget(self, ctx: PolicyContext) -> StepBudget:
        return StepBudget(prefill_tokens=7, total_tokens=9, chunk_size=5)


class SaysItDoesNotOrder(Policy):
    orders = False  # an explicit flag is kept

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        return list(reversed(waiting))


def test_a_hook_defined_without_its_flag_sets_the_flag() -> None:
    assert ShortestNoFlag.orders and not ShortestNoFlag.budgets
    assert SmallBudgetNoFlag.budgets and not SmallBudgetNoFlag.orders
    assert not SaysItDoesNotOrder.orders


def test_an_ordering_without_its_flag_orders_inside_a_composition() -> None:
    assert_starts_shortest_first(f"{HERE}:ShortestNoFlag+token-budget")


def test_a_budget_without_its_flag_budgets_inside_a_composition() -> None:
    policy = make_policy(f"lpm+{HERE}:SmallBudgetNoFlag")
    assert policy.budget(ctx()) == StepBudget(prefill_tokens=7, total_tokens=9, chunk_size=5)
    assert EngineConfig(policy=f"{HERE}:ShortestNoFlag+{HERE}:SmallBudgetNoFlag").policy
