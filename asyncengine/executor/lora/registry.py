"""The adapters an executor serves: name -> PEFT directory, with the most recently used ones
held in memory (``max_loaded``, the config's ``max_cpu_loras``) besides those that requests in
flight run under (``hold``: they stay until released), and the others read back from disk.

The AsyncEngine holds a request's adapter before queueing it, reading it back off the forward
thread when it is not in memory (``read``, then ``install``), so a step finds every adapter it
runs in memory and a failed read refuses only that adapter's requests. A driver that holds
nothing (an EngineCore run directly) has a dropped adapter read back by the step that needs it.

Adds, removes and steps run on the forward thread (the engine runs loads and unloads there,
between steps), so a step never sees an adapter half added or removed; holds and installs come
from the event loop's thread, under the lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.lora.peft_adapter import LoraAdapter, LoraLoadError, load_peft_adapter

log = logging.getLogger("asyncengine.executor.lora")


class UnknownLoraError(LoraLoadError):
    """A name no adapter is registered under."""


class LoraRegistry:
    def __init__(
        self,
        model_config: ModelConfig,
        max_rank: int,
        max_loaded: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.dtype = dtype
        self.device = device
        self.paths: dict[str, str] = {}
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._held: set[str] = set()  # adapters of requests in flight: never dropped
        self._lock = threading.Lock()
        self.loads_from_disk = 0  # reloads of an adapter dropped from memory

    def _read(self, name: str, path: str) -> LoraAdapter:
        return load_peft_adapter(
            name, path, self.model_config, self.max_rank, self.dtype, self.device
        )

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and check the adapter, then serve it as ``name`` (replacing one of that name).
        A refused adapter (LoraLoadError) leaves the registry as it was."""
        adapter = self._read(name, str(path))
        with self._lock:
            self.paths[name] = str(path)
            self._loaded[name] = adapter
            self._loaded.move_to_end(name)
            self._drop_beyond(keep={name})
        log.info(
            "LoRA adapter %s loaded from %s: rank %d, modules %s, %.1f MiB",
            name,
            path,
            adapter.rank,
            ",".join(adapter.target_modules),
            adapter.nbytes / 2**20,
        )
        return adapter

    def remove(self, name: str) -> bool:
        with self._lock:
            self._loaded.pop(name, None)
            return self.paths.pop(name, None) is not None

    def hold(self, name: str) -> bool:
        """Keep ``name`` in memory for a request in flight: False when its weights must be read
        back first (``read``, then ``install``)."""
        with self._lock:
            if name not in self._loaded:
                return False
            if self.max_loaded is not None:  # unbounded, none is ever dropped
                self._held.add(name)
            self._loaded.move_to_end(name)
            return True

    def read(self, name: str) -> LoraAdapter:
        """``name``'s weights read from its directory (any thread but the forward's, which it
        does not block); LoraLoadError when they cannot be."""
        with self._lock:
            path = self.paths.get(name)
        if path is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
        return self._read(name, path)

    def install(self, name: str, adapter: LoraAdapter) -> None:
        """Hold ``adapter``, read back by ``read``, in memory (unless ``name`` was removed
        meanwhile); memory goes back to ``max_loaded`` at the next step."""
        with self._lock:
            if name not in self.paths:
                return
            if name not in self._loaded:
                self._loaded[name] = adapter
                self.loads_from_disk += 1
            self._held.add(name)
            self._loaded.move_to_end(name)

    def release_all_but(self, names: Iterable[str]) -> None:
        """Only ``names`` (the adapters of the requests in flight) stay held."""
        with self._lock:
            self._held = set(names)

    @property
    def loaded(self) -> list[str]:
        """Names held in memory, least recently used first."""
        return list(self._loaded)

    def adapters(self, names: set[str]) -> dict[str, LoraAdapter]:
        """The adapters of one step (read from disk where dropped and held by no request); the
        least recently used of the others not held are dropped down to ``max_loaded``."""
        with self._lock:
            missing = {name: self.paths.get(name) for name in names if name not in self._loaded}
        read: dict[str, LoraAdapter] = {}
        for name, path in missing.items():
            if path is None:
                raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
            read[name] = self._read(name, path)
        with self._lock:
            for name, adapter in read.items():
                if name not in self._loaded:
                    self._loaded[name] = adapter
                    self.loads_from_disk += 1
            out: dict[str, LoraAdapter] = {}
            for name in names:
                self._loaded.move_to_end(name)
                out[name] = self._loaded[name]
            self._drop_beyond(keep=names)
        return out

    def _drop_beyond(self, keep: set[str]) -> None:
        if self.max_loaded is None:
            return
        keep = keep | self._held
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if name not in keep:
                del self._loaded[name]
