"""POST /v1/embeddings: OpenAI's embeddings endpoint over ``engine.embed`` (pooling.py).

``input`` is a string, a list of strings, a list of token ids, or a list of such lists; every
item is one prefill-only request, queued together so the scheduler batches them. The vectors
are unit length, pooled as the model says (mean or last token); ``dimensions`` other than the
model's own is refused (no truncated embeddings), ``encoding_format`` is "float" or "base64"
(little-endian float32, as OpenAI's).
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Annotated, Literal

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from asyncengine.common.outputs import EmbeddingOutput
from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.server.body import read_json
from asyncengine.server.errors import invalid_request
from asyncengine.server.off_loop import input_chars, run_sized
from asyncengine.server.state import OUTCOME, STATE

MAX_INPUTS = 2048  # OpenAI's limit of items per request

TokenId = Annotated[int, Meta(ge=0)]
EmbeddingInput = str | list[str | TokenId | list[TokenId]]


class EmbeddingRequest(Struct, kw_only=True):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None  # accepted, as OpenAI's, and not used


def embedding_inputs(value: EmbeddingInput) -> list[str | list[int]]:
    """The items to embed: one string, strings, one token list, or token lists (not mixed)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid_request("input is empty", param="input")
    if len(value) > MAX_INPUTS:
        raise invalid_request(f"input has more than {MAX_INPUTS} items", param="input")
    if all(isinstance(item, int) for item in value):
        return [[int(item) for item in value if isinstance(item, int)]]
    if all(isinstance(item, str) for item in value):
        return [item for item in value if isinstance(item, str)]
    if all(isinstance(item, list) for item in value):
        return [item for item in value if isinstance(item, list)]
    raise invalid_request(
        "input must be a string, a list of strings, a list of token ids or a list of token "
        "id lists (not a mix)",
        param="input",
    )


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = await read_json(request, state, EmbeddingRequest)
    model = state.check_model(req.model)
    items = embedding_inputs(req.input)
    engine = state.engine
    try:
        prompts = await run_sized(  # all checked first
            input_chars(items), lambda: [engine.intake.accept_embedding(i) for i in items]
        )
    except InvalidRequestError as exc:
        exc.param = exc.param or "input"  # a token id outside the vocabulary, say
        raise
    tasks = [asyncio.ensure_future(engine.embed(prompt)) for prompt in prompts]
    try:
        outputs: list[EmbeddingOutput] = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if req.dimensions is not None and req.dimensions != len(outputs[0].embedding):
        raise invalid_request(
            f"dimensions={req.dimensions} is not supported: this model's embeddings have "
            f"{len(outputs[0].embedding)} dimensions",
            param="dimensions",
            code="unsupported_parameter",
        )
    request[OUTCOME] = "success"
    prompt_tokens = sum(out.prompt_tokens for out in outputs)
    body = {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode(out.embedding, req.encoding_format),
            }
            for i, out in enumerate(outputs)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def add_embeddings_route(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
