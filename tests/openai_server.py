"""Module-scoped fixtures shared by the OpenAI-endpoint tests: one server on the tiny model per
test module, and an ``openai`` (and an ``anthropic``) client for it; the same on the tiny model
whose tokenizer adds a BOS (``bos_server``, ``bos_client``). Import the names into a test module
to use them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import pytest_asyncio

from tests.server_support import (
    RunningServer,
    bos_model_dir,
    engine_config,
    start_server,
    tiny_model_dir,
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(tiny_model_dir(tmp_path_factory)))
    yield running
    await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def claude(server: RunningServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="unused", max_retries=0
    ) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bos_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningServer]:
    running = await start_server(engine_config(bos_model_dir(tmp_path_factory)))
    yield running
    await running.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bos_client(bos_server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=bos_server.base_url + "/v1", api_key="unused", max_retries=0
    ) as c:
        yield c
