"""RemoteEngine: the AsyncEngine interface of the HTTP app, served by a Ray Serve deployment.

The app calls ``stream``/``generate``/``abort`` as on a local engine. Each call goes through
the deployment handle with the prompt as given (the replica tokenizes and validates it) and the
prompt's token ids for the router (tokenized here with the model's tokenizer, no weights
loaded), keyed as the replica's prefix cache keys them (under the request's salt and adapter).
A replica's engine errors come back as the same exceptions (so the same HTTP errors); a replica
that dies fails its requests with RequestFailedError, never a hang. Ray Serve holds a request
while no replica is up, with no bound: one that has seen no replica up for
``NO_REPLICA_WAIT_SECONDS`` in a row is cancelled there and fails with
EngineUnavailableError (a 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asyncengine.api.intake import Intake
from asyncengine.common.cache_salt import salted_ids
from asyncengine.common.config import EngineConfig
from asyncengine.common.errors import (
    EngineError,
    EngineNotRunningError,
    EngineUnavailableError,
    RequestFailedError,
)
from asyncengine.common.outputs import EmbeddingOutput, GenerateOutput, StreamDelta
from asyncengine.common.sampling_params import InvalidRequestError, SamplingParams
from asyncengine.server.errors import ENGINE_ERRORS
from asyncengine.server.ray_serve.registry import router_for
from asyncengine.server.ray_serve.replica import (
    ADMISSION_BLOCKED,
    EVICTION_BY_RULE,
    EVICTION_POLICY,
    EVICTION_RULE,
)

log = logging.getLogger("asyncengine.server.ray")

CONTROL_CALL_TIMEOUT_SECONDS = 30.0
# how often a call for one replica (flush, abort) checks that the router still lists it: Ray
# Serve holds a call for a replica that died until the call is cancelled
REPLICA_GONE_POLL_SECONDS = 0.25
# how long a request waits in Ray Serve while no replica is up (all died, none restarted yet)
# before it fails, and how often it checks (a replica that is up answers or fails it itself)
NO_REPLICA_WAIT_SECONDS = 30.0
NO_REPLICA_POLL_SECONDS = 1.0
# at stop: how long the requests the replicas aborted get to deliver their final deltas before
# the calls still open are cancelled (a cancelled call ends as a failure, not an abort)
ABORT_DELIVERY_SECONDS = 5.0
# stats of several replicas that are not added up
_NOT_SUMMED = frozenset({"cache_hit_rate", "new_token_ratio"})


def engine_error(exc: BaseException, request_id: str) -> Exception:
    """The engine exception a failed replica call stands for."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import RequestCancelledError

    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, ENGINE_ERRORS):
        return cause
    if isinstance(exc, RayActorError):
        return RequestFailedError(f"the replica serving request {request_id} died")
    if isinstance(exc, RequestCancelledError):
        return RequestFailedError(f"request {request_id} was cancelled")
    return RequestFailedError(f"request {request_id} failed: {type(cause).__name__}: {cause}")


def route_ids(tokenizer: Any, prompt: Any, params: SamplingParams) -> list[int]:
    """The prompt's token ids as the replica's prefix cache keys them (under the request's
    ``cache_salt`` and adapter, so tenants' prompts never match each other's pages); [] when the
    prompt is malformed (the replica then refuses it with the precise error)."""
    ids = _prompt_ids(tokenizer, prompt, params.add_special_tokens)
    return salted_ids(ids, params.cache_salt, params.lora)


def _prompt_ids(tokenizer: Any, prompt: Any, add_special_tokens: bool) -> list[int]:
    try:
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if all(isinstance(m, dict) for m in prompt):
                text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
                return list(tokenizer.encode(text))
    except Exception:  # the replica reports what is wrong
        return []
    return []


T = TypeVar("T")


async def while_a_replica_is_up(
    answer: Awaitable[T], replica_ids: Callable[[], list[str]], request_id: str
) -> T:
    """``answer``'s result; EngineUnavailableError once ``replica_ids`` has listed no replica
    for ``NO_REPLICA_WAIT_SECONDS`` in a row (the caller cancels its call in Ray Serve)."""
    waiting = asyncio.ensure_future(answer)
    loop = asyncio.get_running_loop()
    none_since: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=NO_REPLICA_POLL_SECONDS)
            if done:
                return waiting.result()
            if replica_ids():
                none_since = None
            elif none_since is None:
                none_since = loop.time()
            elif loop.time() - none_since >= NO_REPLICA_WAIT_SECONDS:
                raise EngineUnavailableError(
                    f"no replica has been up for {NO_REPLICA_WAIT_SECONDS:g} s to serve "
                    f"request {request_id}"
                )
    finally:
        if not waiting.done():
            waiting.cancel()


class ReplicaGoneError(Exception):
    """The replica a call was for left the deployment (it died) before it answered."""


class RemoteStream:
    """An engine stream whose deltas come from a replica (async iterator with ``aclose``); it
    ends when each of the request's ``choices`` has had its final delta."""

    def __init__(
        self,
        call: Any,
        request_id: str,
        calls: dict[str, Any],
        choices: int,
        replica_ids: Callable[[], list[str]],
    ) -> None:
        self.request_id = request_id
        self._call = call
        self._replica_ids = replica_ids
        self._calls = calls
        self._open_choices = choices
        self._accepted = False  # the replica's first item (None: accepted) was read
        self._admitted = False  # its second (the prompt tokens read from cache) was read
        self._cached_tokens: int | None = None

    def __aiter__(self) -> RemoteStream:
        return self

    async def accepted(self) -> None:
        """Return once the replica's engine accepted the request; raise its refusal instead."""
        if not self._accepted:
            self._accepted = True
            try:  # until a replica takes it: Ray Serve would hold it while none is up
                marker = await while_a_replica_is_up(
                    self._item(), self._replica_ids, self.request_id
                )
            except EngineUnavailableError:
                await self.aclose()
                raise
            assert marker is None, "a replica's stream opens with None"

    async def admitted(self) -> int | None:
        """Return once the replica's engine scheduled the request, with its prompt tokens read
        from the prefix cache."""
        await self.accepted()
        if not self._admitted:
            self._admitted = True
            cached = await self._item()
            assert isinstance(cached, int), "a replica's stream goes on with its cached tokens"
            self._cached_tokens = cached
        return self._cached_tokens

    async def __anext__(self) -> StreamDelta:
        await self.admitted()
        delta = await self._item()
        assert isinstance(delta, StreamDelta)
        return delta

    async def _item(self) -> StreamDelta | int | None:
        try:
            delta: StreamDelta | Exception | int | None = await self._call.__anext__()
        except StopAsyncIteration:
            self._calls.pop(self.request_id, None)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._calls.pop(self.request_id, None)
            raise engine_error(exc, self.request_id) from None
        if isinstance(delta, Exception):  # the engine refused the request
            self._calls.pop(self.request_id, None)
            raise delta
        if isinstance(delta, StreamDelta) and delta.finished:
            self._open_choices -= 1
            if self._open_choices == 0:
                self._calls.pop(self.request_id, None)
        return delta

    async def aclose(self) -> None:
        if self._calls.pop(self.request_id, None) is not None:
            self._call.cancel()


class RemoteEngine:
    """What the HTTP app needs of an engine, over the deployment ``handle``."""

    def __init__(self, config: EngineConfig, handle: Any, app_name: str) -> None:
        self.config = config
        self.app_name = app_name
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self._calls: dict[str, Any] = {}  # request id -> its DeploymentResponse(Generator)
        self._info: dict[str, Any] = {}
        self._tokenizer: Any = None
        self._intake: Intake | None = None
        self._running = False

    async def start(self) -> RemoteEngine:
        """Ask a replica what it serves and load the tokenizer for routing."""
        from asyncengine.executor.loader import tokenizer_dir
        from asyncengine.text.tokenizer import Tokenizer

        self._info = await asyncio.wait_for(
            self._handle.info.remote(), CONTROL_CALL_TIMEOUT_SECONDS
        )
        self._tokenizer = await asyncio.to_thread(
            lambda: Tokenizer(tokenizer_dir(self.config.model))
        )
        self._intake = Intake(self._tokenizer, self.vocab_size, self.max_model_len, self.config)
        self._running = True
        return self

    async def stop(self) -> None:
        """Abort what is in flight, as a local engine does: the replicas end each request with
        its final ``abort`` output; a call they do not end in time is cancelled. The deployment
        itself is the server's to tear down."""
        self._running = False
        in_flight = list(self._calls)
        if in_flight:
            await self._abort_on_replicas(in_flight)
            deadline = asyncio.get_running_loop().time() + ABORT_DELIVERY_SECONDS
            while self._calls and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        for rid in list(self._calls):
            self.abort(rid)

    async def _abort_on_replicas(self, request_ids: list[str]) -> None:
        """Ask every replica to abort those of ``request_ids`` it holds."""
        await asyncio.gather(
            *(
                self._on_replica(r, ABORT_DELIVERY_SECONDS, "abort", request_ids)
                for r in self._replica_ids()
            ),
            return_exceptions=True,  # a replica gone or slow: its calls are cancelled below
        )

    def _replica_ids(self) -> list[str]:
        router = self.router()
        return router.replica_ids() if router is not None else []

    async def _on_replica(
        self, replica: str, timeout: float, method: str, *args: Any, **kwargs: Any
    ) -> Any:
        """``method`` on ``replica`` alone: its answer, ReplicaGoneError once the router no
        longer lists the replica, TimeoutError after ``timeout`` seconds. A call left without
        an answer is cancelled in Ray Serve, which would otherwise keep it queued for a replica
        that is gone."""
        call = getattr(self._handle, method).remote(*args, replica=replica, **kwargs)
        answer = asyncio.ensure_future(call)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"no answer in {timeout:.0f}s")
                done, _ = await asyncio.wait({answer}, timeout=min(left, REPLICA_GONE_POLL_SECONDS))
                if done:
                    return answer.result()
                if replica not in self._replica_ids():
                    raise ReplicaGoneError(f"replica {replica} left the deployment")
        finally:
            if not answer.done():
                answer.cancel()
                call.cancel()

    @property
    def is_running(self) -> bool:
        return self._running

    def _require_info(self) -> dict[str, Any]:
        if not self._info:
            raise EngineNotRunningError("the replicas are not started")
        return self._info

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The adapters every replica serves, its config's (hot loads answer 501 here)."""
        return dict(self.config.loras)

    @property
    def max_model_len(self) -> int:
        return int(self._require_info()["max_model_len"])

    @property
    def vocab_size(self) -> int:
        return int(self._require_info()["vocab_size"])

    @property
    def tokenizer(self) -> Any:
        self._require_info()
        return self._tokenizer

    @property
    def intake(self) -> Intake:
        """Tokenizes and validates requests as a replica's engine does."""
        self._require_info()
        assert self._intake is not None
        return self._intake

    def tokenize(self, prompt: Any, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids a replica queues for ``prompt`` under the same ``add_special_tokens``
        (``InvalidRequestError`` if refused)."""
        return self.intake.tokenize(prompt, add_special_tokens)

    # -- requests ---------------------------------------------------------------------------
    def _begin(
        self, params: SamplingParams | None, request_id: str | None
    ) -> tuple[SamplingParams, str]:
        if not self._running:
            raise EngineNotRunningError("the engine is not running")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._calls:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        return params, rid

    def stream(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RemoteStream:
        params, rid = self._begin(params, request_id)
        call = self._streaming.stream.remote(
            prompt, params, request_id=rid, route_ids=route_ids(self._tokenizer, prompt, params)
        )
        self._calls[rid] = call
        choices = max(1, getattr(params, "n", 1))
        return RemoteStream(call, rid, self._calls, choices, self._replica_ids)

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> GenerateOutput:
        """One request's whole output (n = 1)."""
        output: GenerateOutput = await self._call_replica("generate", prompt, params, request_id)
        return output

    async def generate_choices(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> list[GenerateOutput]:
        """One request's ``params.n`` outputs, in index order."""
        outputs: list[GenerateOutput] = await self._call_replica(
            "generate_choices", prompt, params, request_id
        )
        return outputs

    async def embed(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> EmbeddingOutput:
        """One prompt's embedding, from the replica the router picks (its prefix cache)."""
        output: EmbeddingOutput = await self._call_replica("embed", prompt, params, request_id)
        return output

    async def _call_replica(
        self, method: str, prompt: Any, params: SamplingParams | None, request_id: str | None
    ) -> Any:
        params, rid = self._begin(params, request_id)
        call = getattr(self._handle, method).remote(
            prompt, params, request_id=rid, route_ids=route_ids(self._tokenizer, prompt, params)
        )
        self._calls[rid] = call
        try:
            result = await while_a_replica_is_up(call, self._replica_ids, rid)
        except (asyncio.CancelledError, EngineUnavailableError):
            call.cancel()
            raise
        except Exception as exc:
            raise engine_error(exc, rid) from None
        finally:
            self._calls.pop(rid, None)
        if isinstance(result, Exception):  # the engine refused the request
            raise result
        return result

    def abort(self, request_id: str) -> bool:
        """Cancel the replica call; the replica aborts the request and frees its KV."""
        call = self._calls.pop(request_id, None)
        if call is None:
            return False
        call.cancel()
        return True

    async def reset_prefix_cache(self, reset_counters: bool = False) -> None:
        """Empty every replica's prefix cache and the router's tree (EngineError while busy);
        ``reset_counters``: the replicas' counters too, as one engine's."""
        router = self.router()
        replicas = self._replica_ids()
        results = await asyncio.gather(
            *(
                self._on_replica(
                    r, CONTROL_CALL_TIMEOUT_SECONDS, "flush_cache", reset_counters=reset_counters
                )
                for r in replicas
            ),
            return_exceptions=True,
        )
        # a replica that died has nothing left to flush: its replacement starts empty
        failed = [
            (r, e)
            for r, e in zip(replicas, results, strict=True)
            if isinstance(e, BaseException) and not isinstance(e, ReplicaGoneError)
        ]
        if router is not None:
            router.reset_tree()
        if failed:
            replica, error = failed[0]
            cause = error.cause if hasattr(error, "cause") else error
            raise EngineError(f"replica {replica} did not flush its cache: {cause}")

    # -- introspection ------------------------------------------------------------------------
    def router(self) -> Any:
        """This process's AsyncEngineRequestRouter of the deployment (None before a call)."""
        return router_for(self.app_name)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last reported engine stats."""
        router = self.router()
        return router.replica_stats() if router is not None else {}

    def stats(self) -> dict[str, Any]:
        """The replicas' engine stats added up (as one engine's ``stats()``)."""
        per_replica = self.replica_stats()
        total: dict[str, Any] = {}
        for stats in per_replica.values():
            for key, value in stats.items():
                if isinstance(value, (int, float)) and key not in _NOT_SUMMED:
                    total[key] = total.get(key, 0) + value
        hit, miss = total.get("hit_tokens", 0), total.get("miss_tokens", 0)
        total["cache_hit_rate"] = hit / (hit + miss) if hit + miss else 0.0
        # grouped as one engine's stats() has them (GET /admin/policy, /admin/eviction-policy)
        total[ADMISSION_BLOCKED] = _grouped(total, ADMISSION_BLOCKED)
        # one name: the replicas share their config and refuse the live swap
        total[EVICTION_POLICY] = ", ".join(sorted(_grouped(total, EVICTION_POLICY))) or None
        total[EVICTION_RULE] = _grouped(total, EVICTION_RULE)
        by_rule: dict[str, dict[str, Any]] = {}
        for name, count in _grouped(total, EVICTION_BY_RULE).items():
            rule, _, key = name.partition(":")
            by_rule.setdefault(rule, {})[key] = count
        total[EVICTION_BY_RULE] = by_rule
        total["replicas"] = len(per_replica)
        total["model"] = self.model_name
        return total


def _grouped(total: dict[str, Any], group: str) -> dict[str, Any]:
    """The figures reported as ``<group>:<name>`` (replica.reported_stats), by name."""
    prefix = f"{group}:"
    return {key.removeprefix(prefix): v for key, v in total.items() if key.startswith(prefix)}
