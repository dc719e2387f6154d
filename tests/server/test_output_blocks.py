"""The blocks Anthropic's Messages and OpenAI's Responses answer with (server/output_blocks.py),
and the bounded store behind ``previous_response_id`` (server/responses_store.py)."""

from __future__ import annotations

import pytest

from asyncengine.server import chat_output
from asyncengine.server.chat_tools import ChatOutputSpec
from asyncengine.server.errors import ApiError
from asyncengine.server.output_blocks import Block, BlockReader, read_blocks
from asyncengine.server.responses_schema import InputItem
from asyncengine.server.responses_store import ResponseStore
from asyncengine.text.reasoning import ReasoningParser, ReasoningPiece
from asyncengine.text.tool_calls import HERMES

TOOLS_AND_REASONING = ChatOutputSpec(tool_format=HERMES, reasoning_starts_inside=False)
OUTPUT = (
    "<think>Paris, so weather.</think>\n\nLet me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def _summary(blocks: list[Block]) -> list[tuple[str, str, str | None]]:
    return [(b.kind, b.text, b.name) for b in blocks]


def test_a_whole_output_is_reasoning_then_text_then_one_block_per_call() -> None:
    reader = read_blocks(TOOLS_AND_REASONING, OUTPUT)
    assert _summary(reader.blocks) == [
        ("reasoning", "Paris, so weather.", None),
        ("text", "Let me look.\n", None),
        ("tool_call", '{"city": "Paris"}', "get_weather"),
        ("tool_call", '{"zone": "CET"}', "get_time"),
    ]
    assert [b.index for b in reader.blocks] == [0, 1, 2, 3]
    assert reader.finish_reason("stop") == "tool_calls"
    assert reader.finish_reason("length") == "length"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 40])
def test_streamed_pieces_give_the_same_blocks_opened_and_closed_in_turn(step: int) -> None:
    reader = BlockReader(TOOLS_AND_REASONING)
    events = []
    pieces = [OUTPUT[i : i + step] for i in range(0, len(OUTPUT), step)]
    for i, piece in enumerate(pieces):
        events += reader.feed(piece, final=i == len(pieces) - 1)
    assert _summary(reader.blocks) == _summary(read_blocks(TOOLS_AND_REASONING, OUTPUT).blocks)
    open_block = None
    grown: dict[int, str] = {}
    for event in events:  # one block open at a time; deltas add up to the block's text
        if event.kind == "start":
            assert open_block is None
            open_block = event.block.index
        elif event.kind == "delta":
            assert event.block.index == open_block
            grown[open_block] = grown.get(open_block, "") + event.piece
        else:
            assert event.block.index == open_block
            open_block = None
    assert open_block is None
    assert grown == {b.index: b.text for b in reader.blocks}


def test_blank_text_around_calls_makes_no_block_and_plain_text_is_one_block() -> None:
    calls_only = '\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\n'
    assert [b.kind for b in read_blocks(TOOLS_AND_REASONING, calls_only).blocks] == ["tool_call"]
    plain = read_blocks(None, "  <think>not parsed</think> <tool_call>")
    assert _summary(plain.blocks) == [("text", "  <think>not parsed</think> <tool_call>", None)]
    assert read_blocks(None, "").blocks == []


def test_an_output_that_starts_inside_the_think_block_is_reasoning_until_it_closes() -> None:
    spec = ChatOutputSpec(tool_format=None, reasoning_starts_inside=True)
    assert _summary(read_blocks(spec, "still thinking").blocks) == [
        ("reasoning", "still thinking", None)
    ]
    both = read_blocks(spec, "hmm</think>\n\nYes.")
    assert _summary(both.blocks) == [("reasoning", "hmm", None), ("text", "Yes.", None)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Piece(str):
    """A delta that records how much text it was appended to: ``text += piece`` asks a str
    subclass first (its ``__radd__``), so a reader that copies its whole text at each delta
    shows it here."""

    longest_before = 0

    def __radd__(self, before: str) -> str:
        _Piece.longest_before = max(_Piece.longest_before, len(before))
        return before + str(self)


class _PiecesParser(ReasoningParser):
    """The reasoning parser, its reasoning handed on as ``_Piece``s."""

    def feed(self, text: str) -> ReasoningPiece:
        piece = super().feed(text)
        piece.reasoning = _Piece(piece.reasoning)
        return piece


def test_a_delta_is_kept_without_copying_the_text_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's blocks, and a chat reader's reasoning, grow by each delta: the text before it
    is not copied at every delta (work that grows with the square of the output)."""
    _Piece.longest_before = 0
    reader = BlockReader(None)
    for _ in range(200):
        reader.feed(_Piece("word "))
    reader.feed("", final=True)
    assert reader.blocks[0].text == "word " * 200
    monkeypatch.setattr(chat_output, "ReasoningParser", _PiecesParser)
    thinker = chat_output.ChoiceReader(ChatOutputSpec(None, reasoning_starts_inside=True))
    for _ in range(200):
        thinker.read("idea ", final=False)
    assert thinker.reasoning == "idea " * 200
    assert _Piece.longest_before <= len("word "), _Piece.longest_before


def _turn(text: str) -> list[InputItem]:
    return [InputItem(role="user", content=text)]


def test_the_store_follows_a_chain_and_keeps_keys_and_users_apart() -> None:
    store = ResponseStore(max_bytes=1 << 20, ttl=60.0)
    store.put("a", {"id": "a"}, _turn("one"), None, "key-a", "alice", inputs=1)
    store.put("b", {"id": "b"}, _turn("two"), "a", "key-a", "alice", inputs=1)
    assert [i.content for i in store.conversation("b", "key-a", "alice", 1 << 20)] == ["one", "two"]
    for owner, tenant in (("key-a", "bob"), ("key-a", None), ("key-b", "alice"), (None, "alice")):
        with pytest.raises(ApiError) as refused:
            store.conversation("b", owner, tenant, 1 << 20)
        assert refused.value.status == 404
    # another key neither reads nor deletes it
    assert store.get("a", "key-b") is None and store.get("a", None) is None
    assert not store.delete("a", "key-b") and store.get("a", "key-a") is not None
    assert store.delete("a", "key-a") and not store.delete("a", "key-a")
    with pytest.raises(ApiError, match="no longer stored"):
        store.conversation("b", "key-a", "alice", 1 << 20)  # its chain is broken


def test_the_store_forgets_after_the_ttl_and_drops_the_oldest_past_its_size() -> None:
    clock = FakeClock()
    store = ResponseStore(max_bytes=1 << 20, ttl=10.0, clock=clock)
    store.put("a", {"id": "a"}, _turn("x"), None, None, None, inputs=1)
    clock.now = 5.0
    store.put("b", {"id": "b"}, _turn("x"), None, None, None, inputs=1)
    clock.now = 10.0
    assert store.get("a", None) is None and store.get("b", None) is not None
    clock.now = 15.0
    assert len(store) == 0 and store.bytes == 0

    entry = ResponseStore(max_bytes=1 << 20)
    entry.put("probe", {"id": "a"}, _turn("x" * 100), None, None, None, inputs=1)
    size = entry.bytes
    small = ResponseStore(max_bytes=size * 2, ttl=10.0)
    for name in "abc":
        assert small.put(name, {"id": "a"}, _turn("x" * 100), None, None, None, inputs=1)
    assert [small.get(n, None) is not None for n in "abc"] == [False, True, True]
    assert small.bytes == 2 * size
    assert not small.put("big", {"id": "a"}, _turn("x" * 10 * size), None, None, None, inputs=1)
    assert ResponseStore(max_bytes=0).enabled is False
