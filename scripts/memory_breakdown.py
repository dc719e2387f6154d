#!/usr/bin/env python
"""Where a served model's resident memory goes, component by component, phase by phase.

One engine in this process (``AsyncEngine``, as ``asyncengine serve`` runs it), its resident set
read after each phase: the interpreter, the imports, the start (model, tokenizer, pool), one
stream, a long prompt, then ``--concurrency`` streams at once. After each phase the resident
bytes are split by what holds them:

- the GGUF file's map (its pages read while the weights were packed; counted while mapped);
- the weight arena (the quantized projections, packed: executor/cpu/weight_arena.py), and any
  quantized part outside it;
- dense copies of quantized projections (built from their crossover: layers/linear.py), and the
  dense weights of a dense model (oneDNN's prepacked tensors have no address: their size);
- the KV pool (allocated vs resident: a CPU pool is mapped in as slots are first written);
- shared libraries (code: torch, oneDNN, the native kernels), the malloc heap and every other
  anonymous page (activations' free lists, torch and oneDNN scratch, Python objects, the
  tokenizer's tables).

Resident pages of a tensor are counted from /proc/self/pagemap (Linux), the rest from
/proc/self/smaps. Prints a table, writes JSON (``--out``).

    .venv/bin/python scripts/memory_breakdown.py                               # embedded model
    .venv/bin/python scripts/memory_breakdown.py \\
        ~/.cache/asyncengine/models/qwen2.5-1.5b/qwen2.5-1.5b-Q4_K_M.gguf \\
        --engine-arg dtype=float32 --long-prompt 1024 --concurrency 32 --out /tmp/mem.json
"""

from __future__ import annotations

import resource
import time

_STARTED = time.time()
_RSS_AT_START = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

import argparse  # noqa: E402
import asyncio  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRESENT = 1 << 63
MB = 1e6


def status_bytes() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process (bytes)."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def resident_bytes(start: int, nbytes: int) -> int:
    """Bytes of [start, start + nbytes) mapped in now (the pages' present bits in pagemap)."""
    if nbytes <= 0:
        return 0
    first, last = start // PAGE, (start + nbytes - 1) // PAGE
    count = last - first + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read(count * 8)
    import numpy as np

    entries = np.frombuffer(raw, dtype="<u8")
    return int(np.count_nonzero(entries & np.uint64(_PRESENT))) * PAGE


@dataclass
class Mapping:
    start: int
    end: int
    name: str
    rss: int = 0


def smaps() -> list[Mapping]:
    maps: list[Mapping] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            maps.append(Mapping(lo, hi, head[5] if len(head) > 5 else ""))
        elif head[0] == "Rss:":
            maps[-1].rss = int(head[1]) * 1024
    return maps


@dataclass
class Ranges:
    """Address ranges already counted (a tensor seen twice counts once)."""

    seen: set[tuple[int, int]] = field(default_factory=set)

    def resident(self, start: int, nbytes: int) -> int:
        key = (start, nbytes)
        if nbytes <= 0 or key in self.seen:
            return 0
        self.seen.add(key)
        return resident_bytes(start, nbytes)


def model_components(engine: Any, gguf: Path | None) -> dict[str, dict[str, int]]:
    """Resident (and allocated) bytes of each part of the loaded model and its KV pool."""
    import torch

    from asyncengine.executor.layers.linear import Linear, QuantizedLinear
    from asyncengine.kernels.quant_formats import QuantizedTensor

    runner = engine.executor.runner
    model = runner.model
    ranges = Ranges()
    out: dict[str, dict[str, int]] = {}

    def add(name: str, allocated: int, resident: int) -> None:
        entry = out.setdefault(name, {"allocated": 0, "resident": 0})
        entry["allocated"] += allocated
        entry["resident"] += resident

    maps = smaps()
    if gguf is not None:
        real = str(gguf.resolve())
        add(
            "weights: GGUF file map",
            sum(m.end - m.start for m in maps if m.name == real) or 0,
            sum(m.rss for m in maps if m.name == real),
        )
    arena = getattr(model, "_weight_arena", None)
    arena_lo = arena_hi = 0
    if arena is not None:
        arena_lo = arena.buffer.data_ptr()
        arena_hi = arena_lo + arena.buffer.numel()
        add("weights: arena (quantized, packed)", arena.used, ranges.resident(arena_lo, arena.used))
        ranges.seen.add((arena_lo, -1))

    def tensor(name: str, t: torch.Tensor | QuantizedTensor | None) -> None:
        if t is None:
            return
        data = t.data if isinstance(t, QuantizedTensor) else t
        if data.layout != torch.strided:  # oneDNN's opaque packed tensor: its size only
            nbytes = data.numel() * data.element_size()
            add(name, nbytes, nbytes)
            return
        start, nbytes = data.data_ptr(), data.numel() * data.element_size()
        if arena_lo <= start < arena_hi:
            return  # counted with the arena
        add(name, nbytes, ranges.resident(start, nbytes))

    def linear(kind: str, lin: Linear | QuantizedLinear) -> None:
        if isinstance(lin, QuantizedLinear):
            for part in lin.parts:
                tensor(f"weights: {kind} quantized outside the arena", part)
            for panels in lin._i8 or []:
                tensor(f"weights: {kind} int8 panels", panels.data)
            dense = lin._dense
            if dense is not None:
                tensor(f"weights: {kind} dense copies", dense.packed)
                tensor(f"weights: {kind} dense copies", dense.weight)
        else:
            tensor(f"weights: {kind} dense", lin.packed)
            tensor(f"weights: {kind} dense", lin.weight)
        tensor("weights: norms, biases, RoPE tables", lin.bias)

    for layer in model.layers:
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            linear("layers'", lin)
        for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
            tensor("weights: norms, biases, RoPE tables", t)
    linear("LM head", model.lm_head)
    tensor("weights: embedding", model.embed)
    tensor("weights: norms, biases, RoPE tables", model.norm)
    tensor("weights: norms, biases, RoPE tables", model.cos_sin_cache)
    pool = runner.kv_pool
    tensor("KV pool", pool.k)
    tensor("KV pool", pool.v)
    host_kv = getattr(engine.executor, "host_kv", None)
    if host_kv is not None:
        for t in vars(host_kv).values():
            if isinstance(t, torch.Tensor):
                tensor("KV host buffer", t)
    return out


def snapshot(phase: str, engine: Any, gguf: Path | None, seconds: float) -> dict[str, Any]:
    status = status_bytes()
    maps = smaps()
    libraries = sum(m.rss for m in maps if ".so" in m.name)
    heap = sum(m.rss for m in maps if m.name == "[heap]")
    row: dict[str, Any] = {
        "phase": phase,
        "seconds": seconds,
        "rss": status.get("VmRSS", 0),
        "peak_rss": status.get("VmHWM", 0),
        "rss_anonymous": status.get("RssAnon", 0),
        "rss_file": status.get("RssFile", 0),
        "shared_libraries": libraries,
        "malloc_heap": heap,
        "components": {},
    }
    if engine is not None:
        components = model_components(engine, gguf)
        row["components"] = components
        counted = sum(c["resident"] for c in components.values())
        row["other"] = status.get("VmRSS", 0) - counted - libraries
    return row


def prompt_ids(length: int, offset: int, vocab: int) -> list[int]:
    """Token ids no other prompt of the run starts with."""
    return [3 + (offset + i) % (min(vocab, 40000) - 3) for i in range(length)]


async def run(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.config import EngineConfig
    from asyncengine.common.sampling_params import SamplingParams

    rows.append(snapshot("imports", None, None, time.time() - _STARTED))
    settings = dict(args.engine_arg)
    config = EngineConfig.from_toml(None, model=args.model, **settings)
    gguf = Path(args.model) if args.model.endswith(".gguf") else _embedded_gguf(args.model)
    started = time.time()
    engine = AsyncEngine(config)
    await engine.start()
    info: dict[str, Any] = {"start_seconds": time.time() - started}
    try:
        rows.append(snapshot("started", engine, gguf, time.time() - started))
        vocab = engine.executor.spec.vocab_size

        def greedy(n: int) -> SamplingParams:
            return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

        at = time.time()
        await engine.generate(prompt_ids(16, 100, vocab), greedy(args.output_len))
        rows.append(snapshot("one stream", engine, gguf, time.time() - at))
        if args.long_prompt:
            at = time.time()
            await engine.generate(prompt_ids(args.long_prompt, 7000, vocab), greedy(1))
            rows.append(
                snapshot(f"{args.long_prompt}-token prompt", engine, gguf, time.time() - at)
            )
        if args.concurrency:
            at = time.time()
            await asyncio.gather(
                *(
                    engine.generate(
                        prompt_ids(args.prompt_len, 20000 + 97 * i, vocab), greedy(args.output_len)
                    )  # fmt: skip
                    for i in range(args.concurrency)
                )
            )
            rows.append(snapshot(f"{args.concurrency} concurrent", engine, gguf, time.time() - at))
        info["weights"] = engine.executor.weights_summary
        info["dtype"] = str(engine.executor.dtype).removeprefix("torch.")
        info["kv_dtype"] = str(engine.executor.kv_dtype).removeprefix("torch.")
        info["kv_pool_tokens"] = engine.executor.runner.kv_pool.num_slots
    finally:
        await engine.stop()
    return info


def _embedded_gguf(model: str) -> Path | None:
    from asyncengine.executor.loader.default_model import gguf_file

    found = gguf_file(model)
    return None if found is None else Path(found[0])


def table(result: dict[str, Any]) -> str:
    phases = result["phases"]
    names: list[str] = []
    for row in phases:
        for name in row["components"]:
            if name not in names:
                names.append(name)
    header = ["MB resident", *(row["phase"] for row in phases)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(phases)]

    def line(label: str, values: list[Any]) -> None:
        cells = ["-" if v is None else f"{v / MB:,.0f}" for v in values]
        lines.append("| " + " | ".join([label, *cells]) + " |")

    line("RSS", [row["rss"] for row in phases])
    line("peak RSS", [row["peak_rss"] for row in phases])
    for name in names:
        line(name, [row["components"].get(name, {}).get("resident") for row in phases])
    line("shared libraries (code)", [row["shared_libraries"] for row in phases])
    line("other (heaps, anonymous, files)", [row.get("other") for row in phases])
    line("of which the main malloc heap", [row["malloc_heap"] for row in phases])
    allocated = {n: phases[-1]["components"][n]["allocated"] for n in phases[-1]["components"]}
    notes = ", ".join(f"{n}: {v / MB:,.0f}" for n, v in allocated.items())
    info = result["info"]
    return "\n".join(
        [
            f"{result['model']}: weights {info.get('weights')}, dtype {info.get('dtype')}, "
            f"KV {info.get('kv_dtype')} x {info.get('kv_pool_tokens')} tokens, "
            f"start {info.get('start_seconds', 0):.2f} s",
            *lines,
            f"allocated MB at the end: {notes}",
        ]
    )


def main() -> None:
    from asyncengine.common.config import key_value

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--engine-arg", type=key_value, action="append", default=[])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=1024, help="0: none")
    parser.add_argument("--concurrency", type=int, default=32, help="0: none")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = [
        {
            "phase": "interpreter",
            "seconds": 0.0,
            "rss": _RSS_AT_START,
            "peak_rss": _RSS_AT_START,
            "components": {},
            "shared_libraries": None,
            "malloc_heap": None,
        }
    ]
    from systems import finish

    info = asyncio.run(run(args, rows))
    result = {"mode": "memory_breakdown", "model": args.model, "info": info, "phases": rows}
    finish(result, "scripts/memory_breakdown.py", None, _STARTED, args.out, table)


if __name__ == "__main__":
    from asyncengine.script_main import run_main

    run_main(main)
