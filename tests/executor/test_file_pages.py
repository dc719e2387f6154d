"""A served GGUF model holds its weights once: the file's pages read while packing are dropped
(loader/gguf_file.py), every projection's bytes lie in the weight arena, the tied embedding is
the LM head's table, and no dense copy exists before a step asks for one."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncengine.common.config import EngineConfig
from asyncengine.core.builder import build_core
from asyncengine.executor.cpu import weight_arena, weight_pack
from asyncengine.executor.layers.linear import QuantizedLinear
from asyncengine.executor.loader import DEFAULT_MODEL, KNOWN_MODELS
from asyncengine.executor.loader.gguf_file import drop_tensor_pages, read_gguf_file
from asyncengine.executor.model_executor import ModelExecutor, model_core
from asyncengine.kernels.cpu import weight_pack_native
from asyncengine.kernels.quant_formats import QuantizedTensor
from tests.executor.test_weight_arena import mapping_fields, needs_collapse
from tests.native_support import needs_native
from tests.server_support import TINY_MODEL, tiny_model_dir

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc/self/pagemap and smaps are Linux's"
)
PAGE = 4096


def resident(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) mapped into this process now (pagemap)."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return int(np.count_nonzero(entries >> np.uint64(63))) * PAGE


def file_rss(path: Path) -> int:
    """Resident bytes of this process's maps of ``path`` (smaps)."""
    name, total, inside = str(path.resolve()), 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) > 5 and head[5] == name
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def gguf_path() -> Path:
    return Path(KNOWN_MODELS[DEFAULT_MODEL].gguf_path())


def test_dropped_pages_leave_the_process_and_read_back_the_same() -> None:
    file = read_gguf_file(gguf_path())
    tensor = max(file.tensors, key=lambda t: t.n_bytes)
    view = torch.from_numpy(np.asarray(tensor.data))
    before = view.clone()  # touches every page
    address, nbytes = view.data_ptr(), view.numel()
    assert resident(address, nbytes) >= nbytes - 2 * PAGE
    dropped = drop_tensor_pages(view)
    assert dropped >= nbytes - 2 * PAGE  # whole pages inside the tensor
    assert resident(address, nbytes) <= 2 * PAGE  # the two edge pages may stay
    assert torch.equal(view, before)  # read back from the file as they were


def test_memory_outside_a_gguf_map_is_left_alone() -> None:
    tensor = torch.arange(1 << 20, dtype=torch.int32)
    assert drop_tensor_pages(tensor) == 0
    assert torch.equal(tensor, torch.arange(1 << 20, dtype=torch.int32))


@needs_native
def test_the_served_model_holds_its_weights_once() -> None:
    # float32: the file's F32 norms load as views of its map, which keeps the map open
    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32", kv_cache_tokens=256)
    before = file_rss(gguf_path())  # other maps of the file this process holds (other tests')
    core, _ = model_core(config)
    runner = core.executor.runner
    model = runner.model
    # the file's pages went once the weights were packed (a few norms read since may stay)
    assert file_rss(gguf_path()) - before <= 64 * PAGE
    arena = model._weight_arena
    assert arena is not None
    lo, hi = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.buffer.numel()
    linears = [
        p for layer in model.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    ]
    linears.append(model.lm_head)
    held = 0
    for linear in linears:
        assert isinstance(linear, QuantizedLinear)
        assert linear._dense is None  # built by the first step that needs it, not at load
        for part in linear.parts:
            assert lo <= part.data.data_ptr() < hi
            held += part.nbytes
    # the tied embedding is the LM head's table, not a second one
    assert isinstance(model.embed, QuantizedTensor) and model.embed is model.lm_head.parts[0]
    assert held <= arena.used <= held + len(linears) * 4 * 64  # parts, their alignment padding


@needs_native
def test_the_pool_is_the_bytes_asked_for() -> None:
    budget = 8 << 20
    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_bytes=budget)
    core, _ = model_core(config)
    pool = core.executor.runner.kv_pool
    page_bytes = pool.bytes_per_token * pool.page_size
    assert budget - page_bytes < pool.nbytes <= budget


@needs_collapse
@needs_native
async def test_the_engine_moves_the_weights_into_huge_pages_once_ready() -> None:
    """Ready with the weights in plain pages (a fresh huge page is what start-up paid most
    for), in huge pages once the work left for after start-up is done; the answers unchanged."""
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.sampling_params import SamplingParams

    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", kv_cache_tokens=256)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        arena = engine._core().executor.runner.model._weight_arena
        assert arena is not None and arena.huge_pages_deferred
        start = arena.buffer.data_ptr()
        assert int(mapping_fields(start)["AnonHugePages"][0]) == 0
        before = await engine.generate([1, 2, 3, 4], greedy)
        await engine.one_time_work_done()
        assert not arena.huge_pages_deferred
        huge = int(mapping_fields(start)["AnonHugePages"][0]) * 1024
        assert huge >= arena.used - weight_arena.HUGE_PAGE
        after = await engine.generate([1, 2, 3, 4], greedy)
    assert after.token_ids == before.token_ids


@needs_native
def test_a_checkpoints_tensors_go_as_their_packed_copies_are_written(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a safetensors checkpoint is loaded into memory of its own: held until the whole model is
    # packed, a model would need twice its bytes at start-up
    model_dir = tiny_model_dir(tmp_path_factory)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_cache_tokens=256)
    executor = ModelExecutor(config)
    assert executor._weights is not None
    held = [
        weakref.ref(tensor)
        for name, tensor in executor._weights.items()
        if name.endswith("_proj.weight")
    ]
    alive_at_each_write: list[int] = []
    pack_many = weight_pack_native.pack_many

    def counting(jobs: list[weight_pack_native.PackJob], threads: int) -> None:
        # the checkpoint's tensors and the rows earlier calls wrote: none may be held still
        alive_at_each_write.append(sum(ref() is not None for ref in held))
        held.extend(weakref.ref(source.data) for job in jobs for source in job.sources)
        pack_many(jobs, threads)

    monkeypatch.setattr(weight_pack_native, "pack_many", counting)
    monkeypatch.setattr(weight_pack, "DROP_EVERY_BYTES", 1)  # one native call per projection
    build_core(config, executor)
    assert alive_at_each_write == [0] * (4 * TINY_MODEL["num_hidden_layers"] + 1)
