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


def _naive_first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """Where (end index) and which stop string a character-by-character scan meets first."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def _naive_held(text: str, stop: list[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of some stop string."""
    return max(
        (n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
        default=0,
    )


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc|é\U0001f600", max_size=60),
    stop=st.lists(st.text(alphabet="abc|é\U0001f600", min_size=1, max_size=7), max_size=5),
    cuts=st.lists(st.integers(0, 60), max_size=12),
)
def test_incremental_matcher_agrees_with_a_naive_scan(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    """Over random texts, stop sets and splits into deltas: the same first stop (where it ends
    and which string), and after every delta the same held-back text as a naive rescan."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    f = StopStringFilter(stop)
    emitted = ""
    for start, end in zip(bounds, bounds[1:], strict=False):
        scan = f.push(text[start:end])
        emitted += scan.emit
        if scan.matched is not None:
            break
        seen = text[:end]
        assert scan.held == _naive_held(seen, stop)
        assert emitted + f.pending == seen
    first = _naive_first_stop(text, stop)
    if first is None:
        assert f.matched is None
        assert emitted + f.flush() == text
    else:
        stop_end, stop_string = first
        assert f.matched == stop_string
        assert emitted == text[: stop_end - len(stop_string)]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc|", max_size=40),
    stop=st.lists(st.text(alphabet="abc|", min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    early=st.integers(0, 10),
)
def test_matches_ending_in_deltas_that_may_not_stop_are_passed_over(
    text: str, stop: list[str], cuts: list[int], early: int
) -> None:
    """The first ``early`` deltas may not stop (a request below its minimum tokens): the stop
    is the first that a naive scan meets ending after them, even one that began inside them."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = list(zip(bounds, bounds[1:], strict=False))
    f = StopStringFilter(stop)
    emitted = ""
    for index, (start, end) in enumerate(deltas):
        scan = f.push(text[start:end], may_stop=index >= early)
        emitted += scan.emit
        if scan.matched is not None:
            break
        assert emitted + f.pending == text[:end]
    allowed_from = deltas[early - 1][1] if 0 < early <= len(deltas) else 0
    if early > len(deltas):
        allowed_from = len(text)
    first = next(
        (
            (end, max(ending, key=len))
            for end in range(allowed_from + 1, len(text) + 1)
            if (ending := [s for s in stop if text[:end].endswith(s)])
        ),
        None,
    )
    if first is None:
        assert f.matched is None and emitted + f.flush() == text
    else:
        stop_end, stop_string = first
        assert f.matched == stop_string
        assert emitted == text[: stop_end - len(stop_string)]


def _steps_for_held_output(length: int) -> int:
    """Matching steps to stream ``length`` characters, one per delta, all held back by a
    stop string that keeps almost matching (beside 15 other long ones)."""
    stops = ["a" * 9000 + "!"] + [chr(ord("b") + i) * 9000 for i in range(14)] + ["aab"]
    f = StopStringFilter(stops)
    for _ in range(length):
        scan = f.push("a")
        assert scan.emit == "" and scan.matched is None
    assert len(f.pending) == length
    return f.steps


def test_matching_work_per_character_does_not_grow_with_the_held_text() -> None:
    short, long = _steps_for_held_output(1500), _steps_for_held_output(8000)
    assert short <= 2 * 1500 and long <= 2 * 8000
    assert long / 8000 <= short / 1500 * 1.05


def test_matching_work_is_linear_in_the_text_whatever_the_failures() -> None:
    """A text that keeps failing deep into a stop string ("aaa...ab" against "aaa...aa"):
    the failure links bound the total at twice the characters."""
    f = StopStringFilter(["a" * 50 + "c", "a" * 49 + "b" + "x"])
    text = ("a" * 49 + "b") * 200
    for char in text:
        f.push(char)
    assert f.matched is None
    assert f.steps <= 2 * len(text)
