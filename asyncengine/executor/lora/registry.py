"""The adapters an executor serves: name -> PEFT directory, with the most recently used ones
held in memory (``max_loaded``, the config's ``max_cpu_loras``) and the others read back from
disk on their next step.

Called from the forward thread only (the engine runs loads and unloads there, between steps),
so a step never sees an adapter half added or removed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
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
        self.loads_from_disk = 0  # reloads of an adapter dropped from memory

    def _read(self, name: str, path: str) -> LoraAdapter:
        return load_peft_adapter(
            name, path, self.model_config, self.max_rank, self.dtype, self.device
        )

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and check the adapter, then serve it as ``name`` (replacing one of that name).
        A refused adapter (LoraLoadError) leaves the registry as it was."""
        adapter = self._read(name, str(path))
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
        self._loaded.pop(name, None)
        return self.paths.pop(name, None) is not None

    @property
    def loaded(self) -> list[str]:
        """Names held in memory, least recently used first."""
        return list(self._loaded)

    def adapters(self, names: set[str]) -> dict[str, LoraAdapter]:
        """The adapters of one step, read from disk where dropped; the least recently used of
        the others are dropped down to ``max_loaded`` (a step needing more holds them all)."""
        out: dict[str, LoraAdapter] = {}
        for name in names:
            adapter = self._loaded.get(name)
            if adapter is None:
                path = self.paths.get(name)
                if path is None:
                    raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
                adapter = self._read(name, path)
                self.loads_from_disk += 1
                self._loaded[name] = adapter
            self._loaded.move_to_end(name)
            out[name] = adapter
        self._drop_beyond(keep=names)
        return out

    def _drop_beyond(self, keep: set[str]) -> None:
        if self.max_loaded is None:
            return
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if name not in keep:
                del self._loaded[name]
