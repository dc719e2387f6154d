"""Each eviction rule's own order on small trees, a rule of one's own from a file, live swaps
through the core with figures by rule, and the config's checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncengine.cache import RadixCache
from asyncengine.cache.eviction_rule import CachedNode
from asyncengine.common.config import ConfigError, EngineConfig
from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.core.builder import make_policies
from asyncengine.policies.eviction_registry import (
    check_live_eviction_rule,
    make_eviction_rule,
)
from tests.fake_executor import fake_core


def tree(rule: str, **options: object) -> RadixCache:
    return RadixCache(page_size=2, rule=make_eviction_rule(rule, dict(options)))


def insert(cache: RadixCache, tokens: list[int]) -> None:
    cache.insert(tokens, np.arange(100 * tokens[0], 100 * tokens[0] + len(tokens) // 2))


def survivors(cache: RadixCache) -> set[int]:
    return {node.key[0] for node in cache.root.children.values()}


def test_lfu_keeps_a_page_used_often_over_one_used_last() -> None:
    cache = tree("lfu")
    insert(cache, [1, 1, 1, 1])
    for _ in range(5):
        cache.match_prefix([1, 1, 1, 1])
    insert(cache, [2, 2, 2, 2])
    insert(cache, [3, 3, 3, 3])
    cache.evict(4)
    assert survivors(cache) == {1, 3}  # lru would have evicted 1, used longest ago


def test_lfu_ages_a_page_used_often_long_ago() -> None:
    cache = tree("lfu")
    insert(cache, [1, 1])
    cache.match_prefix([1, 1])  # two uses more than a page inserted once
    for first in range(2, 12):  # each eviction raises the floor past the old count
        insert(cache, [first, first])
        cache.evict(2)
    assert 1 not in survivors(cache)
    assert cache.rule.stats()["floor"] >= 3


def test_lfu_takes_no_weight_that_could_not_change_its_order() -> None:
    """Every key and the floor are sums of use counts: scaling the counts scales them all, so
    a weight would be an option accepted that does nothing; it is refused."""
    with pytest.raises(ConfigError, match="eviction_policy_options"):
        make_policies(EngineConfig(eviction_policy="lfu", eviction_policy_options={"weight": 2}))


def test_cost_aware_evicts_the_shallow_page_first() -> None:
    cache = tree("cost-aware", attention_tokens=4)
    insert(cache, [5, 5, 6, 6, 7, 7, 8, 8])  # one deep leaf (depth 0..8)
    insert(cache, [9, 9])  # a shallow one, newer
    cache.evict(2)
    assert survivors(cache) == {5}  # lru would have evicted the older, deep one


def test_queue_aware_keeps_what_a_waiting_prompt_matches() -> None:
    cache = tree("queue-aware")
    insert(cache, [1, 1, 1, 1])
    insert(cache, [2, 2, 2, 2])
    cache.rule.watch_waiting([[1, 1, 1, 1, 4, 4]])
    cache.evict(4)
    assert survivors(cache) == {1}
    cache.rule.watch_waiting([])  # no longer wanted: its plain lru place again
    insert(cache, [3, 3])
    cache.evict(2)
    assert survivors(cache) == {3}


class CountedTokens(list[int]):
    """A prompt that counts the tokens read from it."""

    read = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        part = super().__getitem__(index)
        self.read += len(part) if isinstance(index, slice) else 1
        return part


def test_queue_aware_reads_no_prompt_again_while_the_tree_under_it_is_unchanged() -> None:
    """The rule hears the waiting queue every step: a long waiting prompt must not cost its
    length every step, only the nodes of its cached path."""
    cache = RadixCache(page_size=16, rule=make_eviction_rule("queue-aware"))
    prompts = [CountedTokens([index] + [7] * 4095 + [index]) for index in range(1, 9)]
    for prompt in prompts:
        cache.insert(list(prompt[:4096]), np.arange(256) + 256 * prompt[0])
    cache.rule.watch_waiting(prompts)  # the first step walks each prompt once
    assert cache.rule.stats()["wanted_nodes"] == 8
    for prompt in prompts:
        prompt.read = 0
    for _ in range(3):
        cache.rule.watch_waiting(prompts)
    assert max(prompt.read for prompt in prompts) <= 3  # its first token, once a step
    assert cache.rule.stats()["wanted_nodes"] == 8
    cache.insert([1] * 64, np.arange(4) + 9000)  # a new prefix under a prompt's first token
    cache.rule.watch_waiting(prompts)  # asked again: still the same wanted path
    assert cache.rule.stats()["wanted_nodes"] == 8
    cache.evict(64)  # the wanted pages go last: the new prefix, used last, goes first
    assert cache.prefix_length([1] * 64) == 0
    assert all(cache.prefix_length(list(prompt)) == 4096 for prompt in prompts)


def test_arc_moves_its_bonus_by_ghost_hits() -> None:
    cache = tree("arc", frequent_hits=2, bonus=100.0, step=10.0)
    insert(cache, [1, 1])
    cache.evict(2)  # evicted seen once: a recency ghost
    insert(cache, [1, 1])  # back: recency deserved more room
    assert cache.rule.bonus == 90.0
    cache.match_prefix([1, 1])  # now frequent
    cache.evict(2)
    insert(cache, [1, 1])  # a frequency ghost back
    assert cache.rule.bonus == 100.0
    assert cache.rule.stats()["recent_ghost_hits"] == 1


def test_a_swap_to_arc_hashes_no_page_while_it_has_no_ghosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live swap touches every cached node; arc's ghosts are empty then, so a page seen once
    cannot be one coming back and is not hashed to ask (a warm tree: a stall of the loop)."""
    import asyncengine.policies.eviction_arc as arc

    hashed: list[int] = []
    real_page_keys = arc.page_keys

    def counting(node: CachedNode, page_size: int) -> list[int]:
        keys = real_page_keys(node, page_size)
        hashed.extend(keys)
        return keys

    monkeypatch.setattr(arc, "page_keys", counting)
    cache = tree("lru")
    for first in range(1, 41):
        insert(cache, [first] * 8)
    cache.set_rule(make_eviction_rule("arc"))
    assert hashed == []
    cache.evict(8)  # a ghost now: new leaves are asked about again
    insert(cache, [1] * 8)
    assert hashed


def test_a_rule_of_ones_own_from_a_file(tmp_path: Path) -> None:
    file = tmp_path / "longest_first.py"
    file.write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n"
        "class LongestFirst(EvictionRule):\n"
        "    name = 'longest-first'\n"
        "    def key(self, node):\n"
        "        return -float(len(node.key))\n"
    )
    cache = RadixCache(page_size=2, rule=make_eviction_rule(f"{file}:LongestFirst"))
    insert(cache, [1, 1, 1, 1, 1, 1])
    insert(cache, [2, 2])
    cache.evict(2)
    assert survivors(cache) == {2}


def test_the_guide_s_rule_runs_as_written_from_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/policies.md's DeepLast, as written there, named in a config file beside it."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    (example,) = [b.split("```")[0] for b in guide.split("```python\n") if "class DeepLast" in b]
    (tmp_path / "deep_last.py").write_text(example)
    (tmp_path / "run.toml").write_text('eviction_policy = "deep_last.py:DeepLast"\n')
    monkeypatch.chdir(tmp_path.parent)  # started from another folder than the config's
    config = EngineConfig.from_toml(tmp_path / "run.toml")
    cache = RadixCache(page_size=2, rule=make_eviction_rule(config.eviction_policy))
    insert(cache, [1] * 8)
    insert(cache, [2, 2])  # used last, but shallow
    cache.evict(2)
    assert survivors(cache) == {1}
    core, _ = fake_core(num_pages=24, page_size=4, eviction_policy=config.eviction_policy)
    run(core, [list(range(1, 33)) + [100 + i] * 12 for i in range(6)])
    assert core.stats()["eviction_by_rule"]["deep-last"]["evictions"] > 0


def test_a_rule_without_a_name_reports_as_its_class(tmp_path: Path) -> None:
    file = tmp_path / "deepest_first.py"
    file.write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n"
        "from asyncengine.policies.eviction_lfu import LeastFrequentlyUsed\n"
        "class DeepestFirst(LeastFrequentlyUsed):\n"
        "    def key(self, node):\n"
        "        return -float(node.prefix_len)\n"
        "class OldestFirst(EvictionRule):\n"
        "    pass\n"
    )
    assert make_eviction_rule(f"{file}:OldestFirst").name == "OldestFirst"  # not "lru"
    core, _ = fake_core(num_pages=24, page_size=4, eviction_policy=f"{file}:DeepestFirst")
    system = list(range(1, 33))
    run(core, [system + [100 + i] * 12 for i in range(6)])
    stats = core.stats()
    assert stats["eviction_policy"] == "DeepestFirst"  # neither "lru" nor its base's "lfu"
    assert set(stats["eviction_by_rule"]) == {"DeepestFirst"}
    assert stats["eviction_by_rule"]["DeepestFirst"]["evictions"] > 0


def test_a_rule_whose_key_rises_at_every_read_still_evicts(tmp_path: Path) -> None:
    """A key of time (or a counter) rises between the push and the pop: the node takes its
    place again once, then goes (it looped forever, the event loop with it)."""
    file = tmp_path / "rising.py"
    file.write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n"
        "class RisingKey(EvictionRule):\n"
        "    name = 'rising-key'\n"
        "    reads = 0\n"
        "    def key(self, node):\n"
        "        type(self).reads += 1\n"
        "        return float(type(self).reads)\n"
    )
    cache = RadixCache(page_size=2, rule=make_eviction_rule(f"{file}:RisingKey"))
    for first in (1, 2, 3):
        insert(cache, [first] * 4)
    assert len(cache.evict(4)) >= 1
    assert len(survivors(cache)) <= 2
    cache.check()


def test_the_config_names_the_key_of_a_bad_rule_or_option() -> None:
    with pytest.raises(ConfigError, match="eviction_policy"):
        make_policies(EngineConfig(eviction_policy="mru"))
    with pytest.raises(ConfigError, match="eviction_policy_options"):
        make_policies(EngineConfig(eviction_policy="lfu", eviction_policy_options={"x": 1}))
    with pytest.raises(ConfigError, match="max_pinned_fraction"):
        EngineConfig(max_pinned_fraction=1.5)


def test_a_live_swap_takes_only_built_ins_or_the_start_up_list(tmp_path: Path) -> None:
    check_live_eviction_rule("cost-aware", [])
    with pytest.raises(ValueError, match="may not be swapped in live"):
        check_live_eviction_rule(f"{tmp_path}/x.py:X", [])
    check_live_eviction_rule(f"{tmp_path}/x.py:X", [f"{tmp_path}/x.py:X"])


def run(core, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    for index, prompt in enumerate(prompts):
        core.add(Request(f"r{index}", prompt, SamplingParams(max_new_tokens=2, temperature=0), 0.0))
        while core.has_work():
            core.step()
            core.kv.check_invariant()


def test_a_live_swap_counts_each_rule_apart_and_keeps_the_invariant() -> None:
    core, _ = fake_core(num_pages=24, page_size=4)
    system = list(range(1, 33))
    prompts = [system + [100 + i] * 12 for i in range(6)]
    run(core, prompts)
    assert core.set_eviction_policy("lfu") == "lru"
    run(core, prompts)
    stats = core.stats()
    assert stats["eviction_policy"] == "lfu"
    by_rule = stats["eviction_by_rule"]
    assert set(by_rule) == {"lru", "lfu"}
    assert by_rule["lru"]["evictions"] > 0 and by_rule["lfu"]["hit_tokens"] > 0
    assert by_rule["lfu"]["evicted_recomputed_tokens"] > 0  # the suffixes came back
    with pytest.raises(ConfigError):
        core.set_eviction_policy("nope")
    assert core.stats()["eviction_policy"] == "lfu"


def test_queue_aware_hears_the_waiting_queue_through_the_scheduler() -> None:
    core, _ = fake_core(num_pages=24, page_size=4, eviction_policy="queue-aware")
    prompt = list(range(1, 33))
    run(core, [prompt])
    core.add(Request("w", prompt + [7, 7], SamplingParams(max_new_tokens=1, temperature=0), 0.0))
    core.scheduler.begin_step()  # a step boundary: the rule hears who waits
    assert core.kv.tree.rule.stats()["wanted_nodes"] >= 1


def test_queue_aware_lets_go_of_a_prompt_once_nothing_waits() -> None:
    """A waiting request that leaves the queue without running (aborted) leaves its cached
    pages no more wanted than any other, empty queue or not."""
    core, _ = fake_core(num_pages=24, page_size=4, eviction_policy="queue-aware")
    prompt = list(range(1, 33))
    run(core, [prompt])
    core.add(Request("w", prompt + [7, 7], SamplingParams(max_new_tokens=1, temperature=0), 0.0))
    core.scheduler.begin_step()
    assert core.kv.tree.rule.stats()["wanted_nodes"] >= 1
    assert core.abort("w")
    core.scheduler.begin_step()  # nothing waits now
    assert core.kv.tree.rule.stats()["wanted_nodes"] == 0


def test_a_rule_of_ones_own_is_checked_as_the_built_ins_are(tmp_path: Path) -> None:
    """docs/policies.md: the stateful tests take a rule named in ASYNCENGINE_CHECK_EVICTION, and
    fail one whose key falls as the tree is read (an age in the key, no tree.requeue)."""
    from hypothesis import Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from tests.cache.test_cache_stateful import (
        OWN_RULES_VARIABLE,
        RadixMachine,
        rules_to_check,
    )

    file = tmp_path / "aged.py"
    file.write_text(
        "from asyncengine.cache.eviction_rule import EvictionRule\n"
        "class Aged(EvictionRule):\n"
        "    reads = 0\n"
        "    def key(self, node):\n"
        "        self.reads += 1  # aged by the reads since: falls with every read\n"
        "        return node.hits - self.reads / 8\n"
    )
    rules = rules_to_check({OWN_RULES_VARIABLE: f" {file}:Aged , deep_last.py:DeepLast"})
    assert rules["own_1"] == f"{file}:Aged" and rules["own_2"] == "deep_last.py:DeepLast"
    assert rules["lfu"] == "lfu" and "lru" not in rules  # the base machines check lru
    machine = type("AgedMachine", (RadixMachine,), {"rule_name": rules["own_1"]})
    with pytest.raises(AssertionError, match="lowest key"):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=200, stateful_step_count=40, deadline=None, phases=[Phase.generate]
            ),
        )
