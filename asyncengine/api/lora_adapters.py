"""The LoRA adapters an AsyncEngine serves by name: loaded at start from the config, loaded
and unloaded while serving (``engine.load_lora`` / ``engine.unload_lora``).

A load reads and checks the adapter on the forward thread, between steps; a refused one changes
nothing. An unload takes the name away from new requests at once; the adapter's weights stay
with the executor until no request in flight runs under it (they finish as they began).

Each load of a name is served under a key of its own (``keys``: the name for its first load,
``name/2``, ``name/3``... for later ones; no name holds a '/'), which requests carry as their
``lora``: the executor holds the adapter under it and the prefix cache keys its pages by it, so
a name loaded again (over the old one, or after an unload) never meets the old weights' KV, and
the requests in flight under the old weights finish under them.

With ``max_cpu_loras`` an adapter may have been dropped from memory: a request for it is held
(``hold``) while its weights are read back off the forward thread, once for all the requests
that wait for it, so a step never reads files. When they cannot be read (its directory deleted,
unreadable or corrupt), its requests are refused with AdapterUnavailableError and nothing else
is touched; requests for it are served again once its files are back, or it can be unloaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor as ThreadPool
from pathlib import Path
from typing import Any, Protocol

from asyncengine.common.errors import AdapterUnavailableError, UnknownAdapterError
from asyncengine.common.sampling_params import LORA_NAME_RULE, InvalidRequestError, is_lora_name

log = logging.getLogger("asyncengine.api.engine")


class AdapterMemory(Protocol):
    """What the executor's LoraRegistry offers for holding adapters in memory."""

    def hold(self, name: str) -> bool: ...
    def read(self, name: str) -> Any: ...
    def install(self, name: str, adapter: Any) -> None: ...


class LoraAdapters:
    def __init__(self, configured: dict[str, str]) -> None:
        self.paths: dict[str, str] = dict(configured)  # served now: name -> PEFT directory
        # served now: name -> the key of its current load (the intake's view, shared in place)
        self.keys: dict[str, str] = {name: name for name in configured}
        self._loads: dict[str, int] = dict.fromkeys(configured, 1)  # loads of each name so far
        self._retiring: set[str] = set()  # keys unloaded or replaced, held by requests in flight
        self._reading: dict[str, asyncio.Future[None]] = {}  # keys being read back into memory

    async def load(
        self,
        name: str,
        path: str | Path,
        registry: object,
        worker: ThreadPool,
        base_name: str,
    ) -> None:
        """Read and check the adapter on the forward thread, then serve it as ``name``.
        InvalidRequestError for a bad name or an adapter the base model refuses."""
        if not is_lora_name(name):
            raise InvalidRequestError(f"a LoRA adapter name is {LORA_NAME_RULE}", param="lora_name")
        if name == base_name:
            raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
        add = getattr(registry, "add", None)
        if add is None:
            raise InvalidRequestError("this engine's executor serves no LoRA adapters")
        from asyncengine.executor.lora.peft_adapter import LoraLoadError

        loads = self._loads.get(name, 0)
        key = name if loads == 0 else f"{name}/{loads + 1}"
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(worker, add, key, str(path))
        except LoraLoadError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        self._loads[name] = loads + 1
        replaced = self.keys.get(name)
        if replaced is not None:
            self._retiring.add(replaced)
        self.keys[name] = key
        self.paths[name] = str(path)

    def unload(self, name: str) -> None:
        """Serve ``name`` to no new request; its weights go once its requests are done
        (``drop_idle``)."""
        if name not in self.paths:
            raise UnknownAdapterError(name, sorted(self.keys))
        del self.paths[name]
        self._retiring.add(self.keys.pop(name))

    def drop_idle(self, in_flight: Iterable[str | None], remove: Callable[[str], object]) -> None:
        """Remove from the executor the unloaded (replaced) adapters' keys no request in flight
        runs under (``in_flight``: their ``lora`` keys)."""
        if not self._retiring:
            return
        busy = set(in_flight)
        for name in list(self._retiring):
            if name not in busy:
                self._retiring.discard(name)
                remove(name)

    @property
    def retiring(self) -> bool:
        """Some unloaded (replaced) adapter's weights wait for its requests to finish."""
        return bool(self._retiring)

    def hold(self, key: str | None, registry: AdapterMemory | None) -> Awaitable[None] | None:
        """Keep the adapter ``key`` (a request's ``lora``) in memory while the request is in
        flight: None when it is there (or the executor serves none), else its read back, which
        raises AdapterUnavailableError when its files cannot be read."""
        if key is None or registry is None or registry.hold(key):
            return None
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read_back(key, registry))
            self._reading[key] = reading
            reading.add_done_callback(lambda done: self._read_done(key, done))
        return asyncio.shield(reading)  # a waiter aborted leaves the read to the others

    def _read_done(self, key: str, reading: asyncio.Future[None]) -> None:
        del self._reading[key]
        if not reading.cancelled():
            reading.exception()  # each waiter has it; none left is no error to report

    async def _read_back(self, key: str, registry: AdapterMemory) -> None:
        from asyncengine.executor.lora.peft_adapter import LoraLoadError

        loop = asyncio.get_running_loop()
        try:
            adapter = await loop.run_in_executor(None, registry.read, key)
        except (LoraLoadError, OSError) as exc:
            log.warning("LoRA adapter %s could not be read back: %s", key, exc)
            raise AdapterUnavailableError(key.split("/")[0]) from None
        registry.install(key, adapter)
