"""Stop strings over streamed text: matches, held-back tails, and independence from chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.text.stop_strings import StopScan, StopStringFilter, scan_stop_strings


def test_match_cuts_before_the_stop_string() -> None:
    assert scan_stop_strings("Hello<|end|> more", ["<|end|>"]) == StopScan("Hello", "<|end|>", 0)


def test_tail_that_could_start_a_stop_string_is_held() -> None:
    assert scan_stop_strings("Hello <|e", ["<|end|>"]) == StopScan("Hello ", None, 3)
    assert scan_stop_strings("Hello", ["lo!", "llo world"]) == StopScan("He", None, 3)
    assert scan_stop_strings("abc", ["xyz"]) == StopScan("abc", None, 0)
    assert scan_stop_strings("", ["x"]) == StopScan("", None, 0)
    assert scan_stop_strings("abc", []) == StopScan("abc", None, 0)


def test_the_match_ending_first_wins_then_the_longest() -> None:
    assert scan_stop_strings("xabcd", ["abcd", "bc"]) == StopScan("xa", "bc", 0)
    assert scan_stop_strings("xabc", ["bc", "abc"]) == StopScan("x", "abc", 0)


def test_filter_streams_across_deltas() -> None:
    f = StopStringFilter(["STOP"])
    assert f.push("one ST") == StopScan("one ", None, 2)
    assert f.push("O") == StopScan("", None, 3)
    assert f.push("P and more") == StopScan("", "STOP", 0)
    assert f.matched == "STOP"
    assert f.push("ignored") == StopScan("", "STOP", 0)
    assert f.flush() == ""


def test_filter_flush_releases_a_false_alarm() -> None:
    f = StopStringFilter(["STOP"])
    assert f.push("almost ST").emit == "almost "
    assert f.flush() == "ST"
    assert StopStringFilter([]).push("anything") == StopScan("anything", None, 0)


def _reference(text: str, stop: list[str]) -> tuple[str, str | None]:
    """Scan one character at a time: stop at the first position where some stop string ends."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)
            return text[: end - len(longest)], longest
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab<|>", max_size=30),
    stop=st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_streamed_output_does_not_depend_on_chunking(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    f = StopStringFilter(stop)
    emitted = ""
    for start, end in zip(bounds, bounds[1:], strict=False):
        scan = f.push(text[start:end])
        emitted += scan.emit
        assert scan.held == len(f.pending)
    emitted += f.flush()
    assert (emitted, f.matched) == _reference(text, stop)
