"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shape
(``{"lora_name", "lora_path"}``): serve a PEFT adapter under a name, or stop serving it, while
the server runs. Both need the admin token (``--admin-token``; a 403 without one, the API key
does not open them): a load reads a directory of the server's files named in the request, and
a name is served to every client, so an API key holder must neither probe the server's paths
nor unload or replace the adapters another key's clients use. The adapter is then selected by
the OpenAI ``model`` field, or ``lora`` on /generate.

A refused load (a rank over ``max_lora_rank``, a module the model lacks, another base's shapes,
not a LoRA adapter) is a 400 and changes nothing; unloading an unknown name is a 404.
"""

from __future__ import annotations

from typing import Annotated, Protocol, runtime_checkable

import msgspec
from aiohttp import web
from msgspec import Meta

from asyncengine.common.sampling_params import MAX_LORA_NAME_LENGTH
from asyncengine.server.admin import LORA_PATHS, check_admin_token
from asyncengine.server.body import read_json
from asyncengine.server.errors import ApiError, invalid_request
from asyncengine.server.state import STATE

MAX_LORA_PATH_LENGTH = 4096
LOAD_PATH, UNLOAD_PATH = LORA_PATHS
LoraName = Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME_LENGTH)]


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: LoraName
    lora_path: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_PATH_LENGTH)]


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: LoraName
    lora_int_id: int | None = None  # vLLM's clients may send it; the name is what counts


@runtime_checkable
class ServesLoras(Protocol):
    async def load_lora(self, name: str, path: str) -> None: ...
    def unload_lora(self, name: str) -> None: ...


def _engine(request: web.Request) -> ServesLoras:
    engine = request.app[STATE].engine
    if not isinstance(engine, ServesLoras):
        raise ApiError(
            501,
            "this server's engines (replicas) do not load or unload LoRA adapters live: "
            "give them at start-up (--lora NAME=PATH), which every replica serves",
            type="not_implemented",
            code="unsupported",
        )
    return engine


async def load_lora_adapter(request: web.Request) -> web.Response:
    check_admin_token(request)
    state = request.app[STATE]
    req = await read_json(request, state, LoadLoraRequest)
    if req.lora_name in state.served_model_names:  # the model field could not reach it
        raise invalid_request(
            f"{req.lora_name!r} is a name the base model is served under",
            param="lora_name",
            code="invalid_request",  # as the engine's refusals of a load (from_engine_error)
        )
    await _engine(request).load_lora(req.lora_name, req.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    check_admin_token(request)
    req = await read_json(request, request.app[STATE], UnloadLoraRequest)
    _engine(request).unload_lora(req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post(LOAD_PATH, load_lora_adapter)
    app.router.add_post(UNLOAD_PATH, unload_lora_adapter)
