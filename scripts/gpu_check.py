#!/usr/bin/env python
"""The Python parts of scripts/gpu_check.sh (one command each; the shell gives each its timeout).

- ``model SRC DST``: a checkpoint of SRC's config.json (the embedded SmolLM2-135M's shape, from
  its GGUF metadata) with random weights, and SRC's tokenizer files. The 98 MB GGUF cannot
  travel to the GPU machine; the benchmarks ignore EOS, so their speed does not depend on the
  weights. ``--tiny``: a 2-layer model of the same vocabulary (the CPU dry run).
- ``decode MODEL``: one decode step at batch 1/64/256 (context 256): the engine's whole step
  (``ModelRunner.execute``: plan -> tensors, CUDA-graph replay, LM head, greedy sampling, ids
  back to the host), the forward alone, the CUDA-graph replay + LM head with nothing on the
  host (the floor the host work adds to), and the weight-read bound (weights + the KV read,
  over a measured device-to-device copy rate).
- ``attention``: the FlashInfer backend against the torch backend (random paged batches of
  extends and decodes), then FlashInfer's decode and extend against the Triton kernels, timed
  at the engine's shapes (9 q / 3 kv heads, head_dim 64, page 16).
- ``summary OUT``: the table of every part's JSON under OUT (printed, and written).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 96,
    "intermediate_size": 128,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- model -----------------------------------------------------------------------------------


def build_model(src: Path, dst: Path, tiny: bool) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((src / "config.json").read_text())
    if tiny:
        config_dict.update(TINY)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config_dict, indent=2))
    config = AutoConfig.from_pretrained(dst)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"random-weight checkpoint at {dst}: {params / 1e6:.1f} M parameters (bf16)")
    return {"parameters": params}


# --- decode step -----------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, bytes read plus written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * n / (ms / 1e3)


def decode_step(model_dir: Path, batches: list[int], context: int, repeats: int) -> dict[str, Any]:
    from asyncengine.cache.page_table import PageTable
    from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
    from asyncengine.common.sampling_params import SamplingParams
    from asyncengine.executor.kv_pool import KVPool
    from asyncengine.executor.layers.model_config import ModelConfig
    from asyncengine.executor.loader import load_hf_config, load_weights
    from asyncengine.executor.runner import ModelRunner

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = ModelConfig.from_hf_dict(load_hf_config(model_dir))
    weights = load_weights(model_dir, dtype)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    page_size = 16
    pages_per_request = -(-(context + 1) // page_size)
    max_batch = max(batches)
    pool = KVPool.for_model(config, pages_per_request * max_batch, page_size, dtype, device)
    pool.k.uniform_(-1, 1)
    pool.v.uniform_(-1, 1)
    table = PageTable.contiguous(max_batch, pages_per_request)
    runner = ModelRunner(
        config,
        weights,
        pool,
        table,
        dtype,
        device=device,
        backend="auto",
        enable_cuda_graph=cuda,
        max_batch_size=max_batch,
    )
    bandwidth = copy_bandwidth(device)
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    rows = []
    for batch in batches:
        segments = [Segment(f"r{b}", b, [100 + b % 1000], context, True) for b in range(batch)]
        plan = BatchPlan(
            step=0,
            decodes=segments,
            sampling=[SamplingInfo(greedy, [1], []) for _ in range(batch)],
        )
        step_ms = median_ms(lambda plan=plan: runner.execute(plan), repeats)
        forward_ms = median_ms(lambda plan=plan: runner.forward_logits(plan), repeats)
        replay_ms = None
        if runner.graphs is not None:
            from asyncengine.executor.cuda_graph import padded_size

            with torch.inference_mode():
                fb = runner.prepare(plan)
                hidden = runner.graphs.run(fb)
                size = padded_size(runner.graphs.ladder, batch)
                graph = runner.graphs._captured[size].graph

                def replay(graph: Any = graph, hidden: torch.Tensor = hidden) -> None:
                    graph.replay()
                    runner.model.compute_logits(hidden)

                replay_ms = median_ms(replay, repeats)  # inside inference_mode, as the engine
        read_bytes = weight_bytes + batch * (context + 1) * kv_token_bytes
        bound_ms = read_bytes / (bandwidth / 2) * 1e3  # bandwidth counted bytes both ways
        row = {
            "batch": batch,
            "context": context,
            "step_ms": step_ms,
            "forward_ms": forward_ms,
            "graph_replay_ms": replay_ms,
            "weight_read_bound_ms": bound_ms,
            "host_ms_over_replay": step_ms - replay_ms if replay_ms is not None else None,
            "step_tokens_per_s": batch / (step_ms / 1e3),
        }
        rows.append(row)
        print(
            f"decode B={batch:<4} step {step_ms:7.3f} ms  forward {forward_ms:7.3f} ms  "
            f"replay+head {replay_ms if replay_ms is not None else float('nan'):7.3f} ms  "
            f"read bound {bound_ms:6.3f} ms",
            flush=True,
        )
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype),
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "cuda_graphs": runner.graphs is not None,
        "backend": runner.backend_name,
        "rows": rows,
    }


# --- attention: FlashInfer against torch and Triton ------------------------------------------


def _random_batch(
    gen: torch.Generator, num_extends: int, num_decodes: int, page_size: int, num_pages: int
) -> Any:
    """A plan of random extends (with cached prefixes) and decodes over distinct random pages."""
    import numpy as np

    from asyncengine.common.plan import BatchPlan, Segment

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    rows = num_extends + num_decodes
    max_pages = num_pages // rows
    perm = torch.randperm(num_pages, generator=gen)[: rows * max_pages].reshape(rows, max_pages)
    table = perm.numpy().astype(np.int32)
    extends, decodes = [], []
    for i in range(rows):
        if i < num_extends:
            new = randint(1, 3 * page_size)
            start = randint(0, max_pages * page_size - new)
            extends.append(Segment(f"e{i}", i, [1] * new, start, True))
        else:
            start = randint(0, max_pages * page_size - 1)
            decodes.append(Segment(f"d{i}", i, [1], start, True))
    return BatchPlan(step=0, extends=extends, decodes=decodes), table


def compare_backends(device: str, dtype: torch.dtype, cases: int, seed: int) -> float:
    """Worst relative error (norm of the difference over the reference's) of the FlashInfer
    backend's output against the torch backend's over random mixed batches."""
    from asyncengine.executor.attention.flashinfer_backend import FlashInferBackend
    from asyncengine.executor.attention.torch_backend import TorchBackend
    from asyncengine.executor.forward_batch import build_forward_batch

    gen = torch.Generator().manual_seed(seed)
    page_size, num_pages, heads, kv_heads, head_dim = 16, 512, 9, 3, 64
    fi = FlashInferBackend(device)
    ref = TorchBackend(native=False)
    worst = 0.0
    for case in range(cases):
        plan, table = _random_batch(
            gen, case % 3, (case * 5) % 7 + (case % 3 == 0), page_size, num_pages
        )
        slots = num_pages * page_size
        k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
        v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(device, dtype)
        fb = build_forward_batch(plan, table, page_size, torch.device(device))
        n = fb.num_tokens
        q = torch.randn(n, heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
        scale = head_dim**-0.5
        outs = []
        for backend in (ref, fi):
            kc, vc = k_cache.clone(), v_cache.clone()
            metadata = backend.build_metadata(fb)
            outs.append(backend.forward(q, k, v, kc, vc, metadata, scale).float())
        expected, got = outs
        err = float((got - expected).norm() / expected.norm())
        if not torch.isfinite(got).all():
            err = float("inf")
        worst = max(worst, err)
        print(f"  case {case}: {len(plan.extends)} extends {len(plan.decodes)} decodes "
              f"rel err {err:.2e}", flush=True)  # fmt: skip
    return worst


def _timed_attention(backend: Any, fb: Any, q: torch.Tensor, caches: tuple, repeats: int) -> float:
    """Milliseconds of one layer's attention (metadata built and planned once, as a forward
    plans once for all its layers)."""
    k_cache, v_cache = caches
    metadata = backend.build_metadata(fb)
    scale = q.shape[-1] ** -0.5
    if hasattr(backend, "attend") and type(backend).__name__ == "FlashInferBackend":
        return median_ms(lambda: backend.attend(q, k_cache, v_cache, metadata, scale), repeats)
    from asyncengine.kernels.triton.triton_decode_attention import (
        choose_num_splits,
        decode_attention,
    )
    from asyncengine.kernels.triton.triton_extend_attention import extend_attention

    if fb.num_extends:
        return median_ms(
            lambda: extend_attention(
                q, k_cache, v_cache, fb.extend_block_table, fb.extend_cu_seqlens_q,
                fb.extend_seq_lens, fb.page_size, scale, max_q_len=fb.extend_max_q_len,
            ),
            repeats,
        )  # fmt: skip
    splits = choose_num_splits(
        fb.num_decodes, k_cache.shape[1], fb.decode_block_table.shape[1] * fb.page_size, q.device
    )
    return median_ms(
        lambda: decode_attention(
            q, k_cache, v_cache, fb.decode_block_table, fb.decode_seq_lens, fb.page_size, scale,
            num_splits=splits,
        ),
        repeats,
    )  # fmt: skip


def time_attention(repeats: int) -> list[dict[str, Any]]:
    """FlashInfer against the Triton kernels: decode at B x ctx, extend of one prompt."""
    from asyncengine.common.plan import BatchPlan, Segment
    from asyncengine.executor.attention.flashinfer_backend import FlashInferBackend
    from asyncengine.executor.attention.triton_backend import TritonBackend
    from asyncengine.executor.forward_batch import build_forward_batch

    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, head_dim, page_size = 9, 3, 64, 16
    shapes = [("decode", 1, 1024), ("decode", 64, 1024), ("decode", 256, 1024),
              ("decode", 256, 4096), ("extend", 1, 1024), ("extend", 8, 512)]  # fmt: skip
    rows = []
    fi = FlashInferBackend(device)
    triton = TritonBackend()
    for kind, batch, length in shapes:
        pages = -(-length // page_size)
        num_pages = batch * pages
        table = torch.arange(num_pages, dtype=torch.int32).reshape(batch, pages).numpy()
        k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        if kind == "decode":
            plan = BatchPlan(
                0, decodes=[Segment(f"r{i}", i, [1], length - 1, True) for i in range(batch)]
            )
        else:
            plan = BatchPlan(
                0, extends=[Segment(f"r{i}", i, [1] * length, 0, True) for i in range(batch)]
            )
        fb = build_forward_batch(plan, table, page_size, device)
        q = torch.randn(fb.num_tokens, heads, head_dim, device=device, dtype=dtype)
        t_ms = _timed_attention(triton, fb, q, (k_cache, v_cache), repeats)
        f_ms = _timed_attention(fi, fb, q, (k_cache, v_cache), repeats)
        rows.append({"kind": kind, "batch": batch, "length": length, "triton_ms": t_ms,
                     "flashinfer_ms": f_ms, "flashinfer_over_triton": f_ms / t_ms})  # fmt: skip
        print(f"  {kind:6} B={batch:<4} len={length:<5} triton {t_ms * 1e3:8.1f} us  "
              f"flashinfer {f_ms * 1e3:8.1f} us  ({f_ms / t_ms:.2f}x)", flush=True)  # fmt: skip
    return rows


def attention(cases: int, repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    try:
        import flashinfer

        result["flashinfer_version"] = flashinfer.__version__
    except Exception as exc:  # reported in the JSON, not hidden
        result["error"] = f"import flashinfer: {exc!r}"
        return result
    if not torch.cuda.is_available():
        from asyncengine.executor.attention.flashinfer_backend import paged_kv_layout

        table = torch.tensor([[3, 1, 2]], dtype=torch.int32)
        layout = paged_kv_layout(table, torch.tensor([20]), 16)
        result["dry_run_layout"] = [layout.indptr.tolist(), layout.indices.tolist()]
        result["skipped"] = "no CUDA: the kernels were not compiled"
        return result
    start = time.perf_counter()
    result["worst_rel_err_vs_torch"] = compare_backends("cuda", torch.bfloat16, cases, 0)
    result["check_seconds_incl_jit"] = time.perf_counter() - start
    result["matches_torch"] = result["worst_rel_err_vs_torch"] < 2e-2
    result["timings"] = time_attention(repeats)
    return result


# --- summary ---------------------------------------------------------------------------------


PARTS = ("offline", "profile", "host_step", "decode", "deterministic", "flashinfer",
         "offline_overlap", "host_step_overlap", "serving")  # fmt: skip


def merge_parts(out: Path) -> dict[str, Any]:
    """Every part's JSON under out/parts, by part, written as out/results.json; parts/ is
    removed once merged (the device tool brings back at most 8 files)."""
    results: dict[str, Any] = {}
    for name in PARTS:
        path = out / "parts" / f"{name}.json"
        try:
            results[name] = json.loads(path.read_text()) if path.is_file() else None
        except json.JSONDecodeError as exc:
            results[name] = {"error": f"unreadable JSON: {exc}"}
    write_json(out / "results.json", results)
    shutil.rmtree(out / "parts", ignore_errors=True)
    return results


def summary(out: Path, dry_run: bool) -> str:
    results = merge_parts(out)

    def _load(_out: Path, name: str) -> dict[str, Any] | None:
        value = results.get(name.removesuffix(".json"))
        return value if isinstance(value, dict) else None

    lines = ["GPU check summary" + (" (DRY RUN on CPU: tiny model, figures meaningless)" if dry_run else ""),
             "Weights are random (the GGUF cannot travel); every benchmark ignores EOS, so speed "
             "does not depend on the weights."]  # fmt: skip
    off = _load(out, "offline.json")
    if off:
        ae = off.get("runs", {}).get("asyncengine", {})
        tok_s, wall = ae.get("output_tokens_per_second", 0.0), ae.get("seconds", 0.0)
        requests = off.get("workload", {}).get("num_requests", "?")
        lines.append(f"(a) offline {requests} requests: {tok_s:,.0f} output tok/s, wall {wall:.2f} s "
                     "(previous H100 figure 6,211 tok/s; target >= 18.6k)")  # fmt: skip
    else:
        lines.append("(a) offline: no result (see log.txt)")
    over = _load(out, "offline_overlap.json")
    if over:
        ae = over.get("runs", {}).get("asyncengine", {})
        lines.append(f"    with enable_overlap_schedule: {ae.get('output_tokens_per_second', 0.0):,.0f} "
                     f"output tok/s, wall {ae.get('seconds', 0.0):.2f} s (target >= 20k on an H200)")  # fmt: skip
    prof = _load(out, "profile.json")
    if prof:
        wall = prof["wall_seconds"]
        steps = prof["steps"]
        lines.append(
            f"    engine host split (a second, instrumented run): {steps} steps, "
            f"{wall / max(steps, 1) * 1e3:.2f} ms/step; on CUDA 'model + LM head' is the "
            "launches and 'sampling' includes the wait for the GPU"
        )
        for part, sec in sorted(prof["in_engine_seconds"].items()):
            lines.append(f"      {part:<38} {sec / max(steps, 1) * 1e3:8.3f} ms/step")
    host = _load(out, "host_step.json")
    if host:
        figure = host.get("host_ms_per_step_256")
        lines.append(f"    stand-in executor (no forward), host ms/step at decode batch 256 on "
                     f"this machine's CPU: {figure if figure is None else round(figure, 3)} (target <= 2)")  # fmt: skip
    lapped = _load(out, "host_step_overlap.json")
    if lapped and lapped.get("rows"):
        row = lapped["rows"][0]
        lines.append(f"    the same with the device's {row['device_ms']:.2f} ms and overlap: step wall "
                     f"{row['host_ms_per_step']:.3f} ms, host CPU {row['cpu_ms_per_step']:.3f} ms, "
                     f"{row['wall_over_bound']:.2f}x max(host, device) (target <= 1.1), "
                     f"{row['planned_ahead']:.0%} planned ahead")  # fmt: skip
    dec = _load(out, "decode.json")
    if dec:
        lines.append(f"(b) decode step ({dec['device']}, {dec['dtype']}, graphs {dec['cuda_graphs']}, "
                     f"copy {dec['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s r+w):")  # fmt: skip
        lines.append(f"    {'B':>4} {'step ms':>9} {'fwd ms':>9} {'replay ms':>9} {'bound ms':>9}")
        for r in dec["rows"]:
            rp = r["graph_replay_ms"]
            lines.append(f"    {r['batch']:>4} {r['step_ms']:9.3f} {r['forward_ms']:9.3f} "
                         f"{rp if rp is not None else float('nan'):9.3f} {r['weight_read_bound_ms']:9.3f}")  # fmt: skip
    else:
        lines.append("(b) decode step: no result")
    serving = _load(out, "serving.json")
    summary_of = serving.get("summary") if serving else None
    if isinstance(summary_of, dict):

        def _ms(metric: str, key: str) -> str:
            value = (summary_of.get(metric) or {}).get(key)
            return "-" if value is None else f"{value * 1e3:.1f}"

        lines.append(f"(s) 64 streams (overlap on): TTFT p50 {_ms('ttft', 'p50')} / p99 "
                     f"{_ms('ttft', 'p99')} ms, ITL p50 {_ms('itl', 'p50')} / p99 {_ms('itl', 'p99')} ms, "
                     f"{summary_of.get('output_throughput') or 0:,.0f} out tok/s")  # fmt: skip
    else:
        lines.append("(s) 64 streams: no result")
    det = _load(out, "deterministic.json")
    if det:
        res = det["results"]
        checked = det["args"]["check"]
        lines.append("(c) deterministic: requests differing alone vs batched: "
                     + ", ".join(f"{m} {r['differing']} of {checked}" for m, r in res.items()))  # fmt: skip
        lines.append("    offline tok/s: " + ", ".join(
            f"{m} {statistics.median(r['offline_tok_s']):.0f}" for m, r in res.items())
            + " (target: deterministic >= 0.5x the default)")  # fmt: skip
    else:
        lines.append("(c) deterministic: no result")
    att = _load(out, "flashinfer.json")
    if att:
        if "error" in att or "skipped" in att:
            lines.append(f"(d) flashinfer: {att.get('error') or att.get('skipped')}")
        else:
            lines.append(f"(d) flashinfer {att['flashinfer_version']}: worst rel err vs torch "
                         f"{att['worst_rel_err_vs_torch']:.2e} (matches: {att['matches_torch']}), "
                         f"check incl. JIT {att['check_seconds_incl_jit']:.0f} s")  # fmt: skip
            for r in att.get("timings", []):
                lines.append(f"    {r['kind']:6} B={r['batch']:<4} len={r['length']:<5} triton "
                             f"{r['triton_ms'] * 1e3:7.1f} us flashinfer {r['flashinfer_ms'] * 1e3:7.1f} us "
                             f"({r['flashinfer_over_triton']:.2f}x)")  # fmt: skip
    else:
        lines.append(
            "(d) flashinfer: no result (see log.txt: compile or import failure, or timeout)"
        )
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("model")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--tiny", action="store_true")
    p = sub.add_parser("decode")
    p.add_argument("model", type=Path)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("attention")
    p.add_argument("--cases", type=int, default=12)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("summary")
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.part == "model":
        build_model(args.src, args.dst, args.tiny)
    elif args.part == "decode":
        batches = [int(b) for b in args.batches.split(",")]
        write_json(args.out, decode_step(args.model, batches, args.context, args.repeats))
    elif args.part == "attention":
        result: dict[str, Any] = {}
        try:
            result = attention(args.cases, args.repeats)
        finally:
            write_json(args.out, result)
    else:
        print(summary(args.out, args.dry_run))


if __name__ == "__main__":
    main()
