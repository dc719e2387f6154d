"""Tokenizing a large input off the event loop.

Tokenizing (and a chat template's rendering) costs time in proportion to the input: a 4 MiB
prompt would hold the event loop, and every other client's stream, for as long. Inputs above
``LARGE_INPUT_CHARS`` are tokenized on a worker thread (one: large inputs queue behind each
other, not in front of everyone); small ones stay on the loop, where a thread hop would cost
more than the work.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asyncengine.api.engine_client import EngineClient
from asyncengine.api.intake import Prompt

T = TypeVar("T")

LARGE_INPUT_CHARS = 16 * 1024
_CHARS_PER_ID = 4  # a token id given as a number stands for about this much text


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="asyncengine-tokenize")


def input_chars(value: Any) -> int:
    """About how many characters ``value`` (a prompt, a list of prompts, chat messages) holds."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return _CHARS_PER_ID
    if isinstance(value, dict):
        return sum(input_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):
            return _CHARS_PER_ID * len(value)
        return sum(input_chars(v) for v in value)
    return 0


async def run_sized(chars: int, work: Callable[[], T]) -> T:
    """``work()``, on the worker thread when it handles ``chars`` >= ``LARGE_INPUT_CHARS``."""
    if chars < LARGE_INPUT_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_worker(), work)


async def tokenize(
    engine: EngineClient, prompt: Prompt, add_special_tokens: bool = False
) -> list[int]:
    """``engine.tokenize(prompt)``, off the loop for a large prompt."""
    return await run_sized(
        input_chars(prompt), lambda: tokenize_now(engine, prompt, add_special_tokens)
    )


def text_prompt_special_tokens(add_special_tokens: bool | None) -> bool:
    """Whether a text prompt (completions, embeddings, /generate, /tokenize's prompt) gets the
    special tokens its tokenizer adds (a BOS): yes unless the request says false, as vLLM,
    SGLang and llama.cpp's server tokenize one. A chat's rendered template brings its own, so
    there it is false unless asked for."""
    return add_special_tokens is not False


def tokenize_now(
    engine: EngineClient, prompt: Prompt, add_special_tokens: bool = False
) -> list[int]:
    """``engine.tokenize(prompt)``; ``add_special_tokens`` (vLLM's): a text prompt gets the
    special tokens its tokenizer adds around a text (a BOS, say), as the chat template's do.
    Given either way: a chat's rendered text must not get the engine's default (True)."""
    return engine.tokenize(prompt, add_special_tokens=add_special_tokens)
