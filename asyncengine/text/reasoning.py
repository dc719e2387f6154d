"""Reasoning in a model's output: ``<think>...</think>`` (Qwen3, DeepSeek-R1, and the models
whose chat template writes these tags) split from the answer, incrementally while streaming.

The reasoning is the text of a leading ``<think>`` block, or, when the prompt already ends
inside one (templates that open ``<think>`` for the model), the text up to ``</think>``. An
output that never closes the block is all reasoning; a ``<think>`` later in the answer is
answer text. Whitespace between ``</think>`` and the answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.text.markers import partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(slots=True)
class ReasoningPiece:
    reasoning: str = ""
    content: str = ""


def template_reasons(template: str | None) -> bool:
    """Whether a chat template writes think blocks (its model reasons before answering)."""
    return template is not None and THINK_OPEN in template and THINK_CLOSE in template


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a think block."""
    opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    return opened > closed and not prompt[opened + len(THINK_OPEN) :].strip()


def prompt_closes_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends with a closed think block: the template turned thinking
    off (Qwen3's ``enable_thinking: false`` writes ``<think>\n\n</think>\n\n``)."""
    opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    return 0 <= opened < closed and not prompt[closed + len(THINK_CLOSE) :].strip()


class ReasoningParser:
    """Feed output text in order; each ``feed`` gives what is now known to be reasoning and
    what is answer; ``finish`` gives the rest."""

    def __init__(self, starts_inside: bool) -> None:
        # "start": before the first non-space text; "think": inside the block; "answer": after
        self._state = "think" if starts_inside else "start"
        self._pending = ""
        self._after_close = False  # strip the whitespace that follows </think>

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        self._pending += text
        while self._pending:
            if self._state == "start":
                head = self._pending.lstrip()
                if THINK_OPEN.startswith(head):  # empty, or the tag maybe cut
                    break
                if head.startswith(THINK_OPEN):
                    self._pending = head[len(THINK_OPEN) :]
                    self._state = "think"
                else:
                    self._state = "answer"
            elif self._state == "think":
                at = self._pending.find(THINK_CLOSE)
                if at < 0:
                    keep = partial_suffix(self._pending, THINK_CLOSE)
                    piece.reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                piece.reasoning += self._pending[:at]
                self._pending = self._pending[at + len(THINK_CLOSE) :]
                self._state, self._after_close = "answer", True
            else:
                if self._after_close:
                    self._pending = self._pending.lstrip()
                    if not self._pending:
                        break
                    self._after_close = False
                piece.content += self._pending
                self._pending = ""
        return piece

    def finish(self) -> ReasoningPiece:
        rest, self._pending = self._pending, ""
        if self._state == "think":
            return ReasoningPiece(reasoning=rest)
        if self._after_close:
            rest = rest.lstrip()
        return ReasoningPiece(content=rest)


def split_reasoning(text: str, starts_inside: bool) -> ReasoningPiece:
    """A whole output's reasoning and answer."""
    parser = ReasoningParser(starts_inside)
    first, last = parser.feed(text), parser.finish()
    return ReasoningPiece(first.reasoning + last.reasoning, first.content + last.content)
