"""POST /v1/embeddings: OpenAI's embeddings endpoint over ``engine.embed`` (pooling.py).

``input`` is a string, a list of strings, a list of token ids, or a list of such lists; every
item is one prefill-only request, queued together so the scheduler batches them. The vectors
are unit length, pooled as the model says (mean or last token); ``dimensions`` other than the
model's own is refused (no truncated embeddings), ``encoding_format`` is "float" or "base64"
(little-endian float32, as OpenAI's). ``truncate_prompt_tokens`` (vLLM's) cuts each input to its
last k tokens (-1: as many as the context holds) before it is checked against the context.
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
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.server.body import read_json
from asyncengine.server.errors import invalid_request
from asyncengine.server.off_loop import (
    input_chars,
    run_sized,
    text_prompt_special_tokens,
    tokenize_now,
)
from asyncengine.server.openai_schema import (
    RefusedUnlessTrue,
    TruncatePromptTokens,
    check_fits_queue,
    check_unsupported,
)
from asyncengine.server.state import OUTCOME, STATE

MAX_INPUTS = 2048  # OpenAI's limit of items per request

TokenId = Annotated[int, Meta(ge=0)]
EmbeddingInput = str | list[str | TokenId | list[TokenId]]


class EmbeddingRequest(Struct, kw_only=True):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None  # the tenant, as on the other routes ("fair" policy, metrics)
    cache_salt: str | None = None  # as on the other routes (and the API key's namespace)
    priority: int = 0
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM's: each input's last k
    # vLLM's: a text input gets its tokenizer's special tokens (a BOS, say)
    add_special_tokens: bool | None = None
    normalize: RefusedUnlessTrue | None = (
        None  # vLLM's, refused unless true (EMBEDDING_UNSUPPORTED)
    )


EMBEDDING_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("normalize", True, "the embeddings are always unit length"),
)


def embedding_inputs(value: EmbeddingInput) -> list[str | list[int]]:
    """The items to embed: one string, strings, one token list, or token lists (not mixed)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid_request("input is empty", param="input")
    if all(isinstance(item, int) for item in value):  # one prompt (the context bounds it)
        return [[int(item) for item in value if isinstance(item, int)]]
    if len(value) > MAX_INPUTS:
        raise invalid_request(f"input has more than {MAX_INPUTS} items", param="input")
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
    model = state.check_model(req.model, adapters=True)
    check_unsupported(req, EMBEDDING_UNSUPPORTED)
    items = embedding_inputs(req.input)
    engine = state.engine
    check_fits_queue(len(items), engine.config.max_waiting_requests, "input")
    try:
        params = SamplingParams(
            max_new_tokens=1,
            tenant=req.user or None,
            cache_salt=req.cache_salt,
            priority=req.priority,
            lora=state.lora_for(model),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        special = text_prompt_special_tokens(req.add_special_tokens)
        accepted = await run_sized(  # all checked first
            input_chars(items),
            lambda: [
                engine.intake.accept_embedding(tokenize_now(engine, i, special), params)
                for i in items
            ],
        )
        prompts = [ids for ids, _ in accepted]
    except InvalidRequestError as exc:
        exc.param = exc.param or "input"  # a token id outside the vocabulary, say
        raise
    outputs: list[EmbeddingOutput] = []
    if req.dimensions is not None:  # one item tells the size: refuse before the others run
        outputs.append(await engine.embed(prompts[0], params))
        if req.dimensions != len(outputs[0].embedding):
            raise invalid_request(
                f"dimensions={req.dimensions} is not supported: this model's embeddings have "
                f"{len(outputs[0].embedding)} dimensions",
                param="dimensions",
                code="unsupported_parameter",
            )
    tasks = [asyncio.ensure_future(engine.embed(p, params)) for p in prompts[len(outputs) :]]
    try:
        outputs += await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
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
