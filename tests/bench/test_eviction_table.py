"""The eviction table compares each rule with the lru run of its own configuration."""

from __future__ import annotations

from asyncengine.bench.eviction_table import EvictionRow, eviction_table


def row(base: str, rule: str, hit_tokens: int) -> EvictionRow:
    return EvictionRow(f"{base} {rule}", base, rule, hit_tokens, 400, 0.5, 1.0, 10.0, 3, 0)


def test_each_rule_gains_over_the_lru_run_of_its_own_configuration() -> None:
    rows = [
        row("fcfs", "lru", 100),
        row("fcfs", "lfu", 120),
        row("lpm", "lru", 200),
        row("lpm", "lfu", 210),
        row("sjf", "lfu", 50),  # no lru run to compare with
    ]
    lines = eviction_table(rows).splitlines()[2:]
    gains = [line.split("|")[6].strip() for line in lines]
    assert gains == ["+0.0%", "+20.0%", "+0.0%", "+5.0%", "-"]


def test_a_run_with_nothing_to_serve_shows_no_share_of_the_bound() -> None:
    """Belady serves 0 tokens (nothing shared, or a pool smaller than any shared prefix)."""
    empty = EvictionRow("fcfs lru", "fcfs", "lru", 0, 0, 0.0, 1.0, 10.0, 22, 0)
    (line,) = eviction_table([empty]).splitlines()[2:]
    assert [cell.strip() for cell in line.split("|")[4:7]] == ["0", "-", "-"]
