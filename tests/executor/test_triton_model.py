"""The Triton attention backend inside the executor, and the choice of backend.

Under the Triton interpreter (CPU): the backend against the torch backend on a mixed batch, and
the whole tiny model's logits with each backend. On a GPU (skipped here): the same model on
CUDA, Triton against torch, in bfloat16.
"""

from __future__ import annotations

import os

# Before triton loads (tests/conftest.py sets it too): run the kernels in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import textwrap

import numpy as np
import pytest
import torch

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan, Segment
from asyncengine.executor.attention.selector import (
    BackendUnavailableError,
    create_attention_backend,
    kernel_ops,
    resolve_backend_name,
)
from asyncengine.executor.attention.torch_backend import TorchBackend
from asyncengine.executor.attention.triton_backend import TritonBackend
from asyncengine.executor.cpu import native_decode
from asyncengine.executor.cuda_graph import DecodeStaticInputs, batch_size_ladder, padded_size
from asyncengine.executor.forward_batch import build_forward_batch
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.reference import norm_ref
from asyncengine.kernels.triton import triton_norm
from tests.conftest import TinyCheckpoint
from tests.paged_pool_support import nan_pool, shuffled_page_table
from tests.python_subprocess import run_python

MAX_LEN = 48
NUM_ROWS = 4


def seg(rid: str, row: int, tokens: list[int], start: int, sample: bool = True) -> Segment:
    return Segment(rid=rid, row=row, input_ids=tokens, start_pos=start, sample=sample)


def mixed_plan(step: int) -> BatchPlan:
    """An extend on a prefix that ends mid-page, a fresh prefill, and two decodes."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(3, 90, MAX_LEN).tolist()
    return BatchPlan(
        step=step,
        extends=[seg("a", 0, tokens[19:30], 19), seg("b", 1, tokens[:7], 0)],
        decodes=[seg("c", 2, [tokens[0]], 33), seg("d", 3, [tokens[1]], 5)],
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(page_size: int) -> None:
    num_kv_heads, group, head_dim = 2, 3, 64
    table, num_pages = shuffled_page_table(NUM_ROWS, MAX_LEN, page_size, page_size, spare_pages=3)
    batch = build_forward_batch(mixed_plan(1), table.array, page_size, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    # The prefix tokens are in the pool already; other slots hold NaN (never to be read).
    cache_k = torch.full(shape, float("nan"))
    cache_v = torch.full(shape, float("nan"))
    for row, length in [(0, 19), (2, 33), (3, 5)]:
        positions = np.arange(length)
        pages = torch.from_numpy(table.array[row, positions // page_size]).long()
        slots = pages * page_size + torch.from_numpy(positions % page_size)
        cache_k[slots] = torch.randn((length, num_kv_heads, head_dim), generator=gen)
        cache_v[slots] = torch.randn((length, num_kv_heads, head_dim), generator=gen)
    n = batch.num_tokens
    q = torch.randn((n, num_kv_heads * group, head_dim), generator=gen)
    k = torch.randn((n, num_kv_heads, head_dim), generator=gen)
    v = torch.randn((n, num_kv_heads, head_dim), generator=gen)

    outputs, caches = [], []
    for backend in (TorchBackend(), TritonBackend()):
        k_cache, v_cache = cache_k.clone(), cache_v.clone()
        metadata = backend.build_metadata(batch)
        outputs.append(backend.forward(q, k, v, k_cache, v_cache, metadata, head_dim**-0.5))
        caches.append((k_cache, v_cache))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
    for want, got in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(got, want, equal_nan=True, atol=0, rtol=0)


class RunnerPair:
    """One torch-backend runner and one Triton-backend runner over identical pools and tables."""

    def __init__(self, ckpt: TinyCheckpoint, page_size: int) -> None:
        config = ModelConfig.from_hf_dict(ckpt.hf_config)
        weights = ckpt.load_weights()
        self.runners: list[ModelRunner] = []
        for backend in ("torch", "triton"):
            table, num_pages = shuffled_page_table(NUM_ROWS, MAX_LEN, page_size, 7, spare_pages=3)
            pool = nan_pool(config, num_pages, page_size)
            with pytest.MonkeyPatch.context() as patch:
                # the Triton runner's decode steps through its backend too: on a CPU a decode
                # batch would otherwise take the fused native decode step
                if backend == "triton":
                    patch.setenv(native_decode.ENABLE_ENV, "0")
                runner = ModelRunner(config, weights, pool, table, torch.float32, backend=backend)
            self.runners.append(runner)

    def check(self, plan: BatchPlan) -> None:
        want, got = (runner.forward_logits(plan) for runner in self.runners)
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def prefill_then_decode_plans() -> list[BatchPlan]:
    """Prefills (c only its first chunk, unsampled), then c's second chunk on a prefix that ends
    mid-page beside decodes, then decodes of all three."""
    rng = np.random.default_rng(11)
    full = {rid: rng.integers(3, 90, MAX_LEN).tolist() for rid in "abc"}
    plans = [
        BatchPlan(
            step=1,
            extends=[
                seg("a", 0, full["a"][:5], 0),
                seg("c", 2, full["c"][:12], 0, sample=False),
                seg("b", 1, full["b"][:23], 0),
            ],
        ),
        BatchPlan(
            step=2,
            extends=[seg("c", 2, full["c"][12:17], 12)],
            decodes=[seg("a", 0, [full["a"][5]], 5), seg("b", 1, [full["b"][23]], 23)],
        ),
    ]
    pos, rows = {"a": 6, "b": 24, "c": 17}, {"a": 0, "b": 1, "c": 2}
    for step in range(3, 5):
        decodes = [seg(rid, rows[rid], [full[rid][p]], p) for rid, p in pos.items()]
        plans.append(BatchPlan(step=step, decodes=decodes))
        pos = {rid: p + 1 for rid, p in pos.items()}
    return plans


@pytest.mark.parametrize(
    ("name", "page_size"),
    [
        ("llama_gqa", 1),
        ("llama_gqa", 16),
        ("qwen3_qk_norm", 16),
        ("gemma", 16),
        ("gemma2", 1),
        ("gemma3", 16),
        ("mistral_window", 4),
    ],
)
def test_model_logits_with_triton_backend_match_torch_backend(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str, page_size: int
) -> None:
    pair = RunnerPair(tiny_checkpoints[name], page_size)
    for plan in prefill_then_decode_plans():
        pair.check(plan)


_CUDA_CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from asyncengine.cache.page_table import PageTable
    from asyncengine.executor.kv_pool import KVPool
    from asyncengine.executor.cuda_graph import DecodeGraphs
    from asyncengine.executor.layers.model_config import ModelConfig
    from asyncengine.executor.runner import ModelRunner
    from asyncengine.common.plan import BatchPlan, Segment

    path, device = sys.argv[1], torch.device(sys.argv[2])
    # optionally a quantized pool ("int8" or "fp8"): a third runner, Triton over it
    pool_name = sys.argv[3] if len(sys.argv) > 3 else ""
    quantized = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(pool_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = ModelConfig.from_hf_dict(json.load(open(f"{path}/config.json")))
    weights = load_file(f"{path}/model.safetensors")
    page_size, rows, pages_per_row = 16, 4, 4
    tokens = np.random.default_rng(0).integers(3, 90, (rows, 40)).tolist()
    plans = [BatchPlan(step=1, extends=[
        Segment(str(r), r, tokens[r][: 5 + 7 * r], 0, True) for r in range(rows)
    ])]
    for step in range(3 if quantized else 1):
        plans.append(BatchPlan(step=2 + step, decodes=[
            Segment(str(r), r, [tokens[r][5 + 7 * r + step]], 5 + 7 * r + step, True)
            for r in range(rows)
        ]))
    runners, logits = [], []
    kinds = [("torch", dtype), ("triton", dtype)] + ([("triton", quantized)] if quantized else [])
    for backend, kv_dtype in kinds:
        table = PageTable(rows, pages_per_row)
        order = np.random.default_rng(1).permutation(rows * pages_per_row + 2)
        for r in range(rows):
            table.set_pages(r, 0, order[r * pages_per_row : (r + 1) * pages_per_row])
        pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim,
                      rows * pages_per_row + 2, page_size, kv_dtype, device)
        runner = ModelRunner(config, weights, pool, table, dtype, device=device, backend=backend)
        logits.append(torch.cat([runner.forward_logits(plan).float() for plan in plans]))
        runners.append(runner)
    scale = logits[0].abs().max().item()
    print("backend_rel_diff", (logits[1] - logits[0]).abs().max().item() / scale)
    if quantized:
        print("pool_rel_diff", (logits[2] - logits[1]).abs().max().item() / scale)

    if device.type == "cuda":  # replay a captured decode step against the eager forward
        runner = runners[-1]
        graphs = DecodeGraphs(runner.model, runner.backend, runner.k_caches, runner.v_caches,
                              max_batch_size=8, max_pages_per_row=pages_per_row,
                              page_size=page_size)
        graphs.capture()
        at = 4 + len(plans)  # the position after the last decode step
        step3 = BatchPlan(step=len(plans) + 1, decodes=[
            Segment(str(r), r, [tokens[r][at + 7 * r]], at + 7 * r, True) for r in range(3)
        ])
        with torch.inference_mode():
            batch = runner.prepare(step3)
            assert graphs.can_run(batch)
            replayed = graphs.run(batch).clone()
            eager = runner.model.forward(batch, runner.backend,
                                         runner.backend.build_metadata(batch),
                                         runner.k_caches, runner.v_caches)
        print("graph_rel_diff", (replayed - eager).abs().max().item() / eager.abs().max().item())
        with torch.inference_mode():  # the whole greedy step (LM head, argmax) as one graph
            tokens = graphs.run_greedy(batch)
            logits = runner.model.compute_logits(replayed)
            top = logits.topk(2, dim=-1).values
            clear = (top[:, 0] - top[:, 1]) > 1e-3 * logits.abs().max()  # no near tie
            wrong = (tokens != logits.argmax(dim=-1)) & clear
        print("graph_greedy_wrong", float(wrong.sum().item()))
    """
)


def run_cuda_check(
    checkpoint: TinyCheckpoint, device: str, interpret: bool, pool: str = ""
) -> dict[str, float]:
    """Run ``_CUDA_CHECK`` in a fresh interpreter, compiled kernels unless ``interpret``;
    ``pool`` ("int8", "fp8"): a Triton runner over that pool too, the graph replayed over it.
    On a CPU without the fused native decode step, which would take the decode steps."""
    args = (str(checkpoint.path), device, *([pool] if pool else []))
    env = {native_decode.ENABLE_ENV: "0"} if device == "cpu" else {}
    stdout = run_python(_CUDA_CHECK, *args, interpret=interpret, env=env)
    figures: dict[str, float] = {}
    for line in stdout.splitlines():
        name, _, value = line.partition(" ")
        if name in ("backend_rel_diff", "pool_rel_diff", "graph_rel_diff", "graph_greedy_wrong"):
            figures[name] = float(value)
    return figures


@pytest.mark.slow
def test_cuda_check_script_runs_on_cpu_under_the_interpreter(tiny_llama: TinyCheckpoint) -> None:
    """The GPU check below, on CPU (no graph capture): keeps its script from rotting."""
    figures = run_cuda_check(tiny_llama, "cpu", interpret=True)
    assert figures["backend_rel_diff"] < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_on_cuda_triton_matches_torch_and_graph_replay_matches_eager(
    tiny_llama: TinyCheckpoint,
) -> None:
    """Compiled kernels (no interpreter) in bfloat16 on the GPU, then a captured decode step."""
    figures = run_cuda_check(tiny_llama, "cuda", interpret=False)
    assert figures["backend_rel_diff"] < 0.05
    assert figures["graph_rel_diff"] < 1e-2
    assert figures["graph_greedy_wrong"] == 0.0


# --- backend selection -------------------------------------------------------------------------


def test_auto_is_torch_on_cpu_and_triton_on_cuda() -> None:
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", "cuda") == "triton"
    assert isinstance(create_attention_backend("auto", "cpu"), TorchBackend)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(create_attention_backend("triton", "cpu"), TritonBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
        resolve_backend_name("triton", "cpu")


def test_flashinfer_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config takes the name; the executor refuses it on a CPU, or without the package,
    at start rather than at the first forward."""
    assert EngineConfig(attention_backend="flashinfer").attention_backend == "flashinfer"
    with pytest.raises(BackendUnavailableError, match="flashinfer"):
        resolve_backend_name("flashinfer", "cpu")
    monkeypatch.setattr(
        "asyncengine.executor.attention.selector._importable", lambda module: module != "flashinfer"
    )
    with pytest.raises(BackendUnavailableError, match="needs the package.*flashinfer"):
        resolve_backend_name("flashinfer", "cuda")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        resolve_backend_name("sdpa", "cpu")


def test_kernel_ops_follow_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncengine.kernels.cpu import cpu_native, layer_ops_native

    # on a CPU the torch backend takes the native kernels (this machine compiles them) ...
    cpu = kernel_ops("torch", "cpu")
    assert cpu.rms_norm is layer_ops_native.rms_norm and cpu.rotary_store is not None
    # ... on a GPU the torch references, and the Triton twins for triton
    assert kernel_ops("torch", "cuda").rms_norm is norm_ref.rms_norm
    assert kernel_ops("torch", "cuda").rotary_store is None
    assert kernel_ops("triton").rms_norm is triton_norm.rms_norm
    # without native kernels the CPU keeps the references
    monkeypatch.setenv(cpu_native.ENABLE_ENV, "0")
    cpu_native.load.cache_clear()
    layer_ops_native._library.cache_clear()
    try:
        assert kernel_ops("torch", "cpu").rms_norm is norm_ref.rms_norm
    finally:
        monkeypatch.delenv(cpu_native.ENABLE_ENV)
        cpu_native.load.cache_clear()
        layer_ops_native._library.cache_clear()
    with pytest.raises(ValueError, match="resolved backend name"):
        kernel_ops("auto")


# --- CUDA-graph padding (the capture itself needs CUDA) ----------------------------------------


def test_batch_size_ladder_and_padding_rungs() -> None:
    ladder = batch_size_ladder(50)
    assert ladder[0] == 1 and ladder[-1] == 50 and ladder == sorted(set(ladder))
    assert padded_size(ladder, 1) == 1
    assert padded_size(ladder, 3) == 4
    assert padded_size(ladder, 49) == 50
    assert padded_size(ladder, 51) is None


def test_padded_decode_batch_gives_the_same_hidden_states_and_writes_nothing_more(
    tiny_llama: TinyCheckpoint,
) -> None:
    """What a captured graph replays, run eagerly: real rows match, padding rows write nothing."""
    page_size = 16
    pair = RunnerPair(tiny_llama, page_size)
    runner = pair.runners[1]  # triton
    rng = np.random.default_rng(5)
    prompts = {rid: rng.integers(3, 90, 20).tolist() for rid in "abc"}
    lengths = {"a": 9, "b": 17, "c": 3}
    runner.forward_logits(
        BatchPlan(
            step=1,
            extends=[
                seg(rid, row, prompts[rid][: lengths[rid]], 0) for row, rid in enumerate("abc")
            ],
        )
    )
    plan = BatchPlan(
        step=2,
        decodes=[
            seg(rid, row, [prompts[rid][lengths[rid]]], lengths[rid])
            for row, rid in enumerate("abc")
        ],
    )
    model, backend = runner.model, runner.backend
    caches = (runner.k_caches, runner.v_caches)
    with torch.inference_mode():
        batch = runner.prepare(plan)
        want = model.forward(batch, backend, backend.build_metadata(batch), *caches)
        pool_after = (runner.kv_pool.k.clone(), runner.kv_pool.v.clone())

        inputs = DecodeStaticInputs(8, runner.page_table.max_pages_per_row, page_size, "cpu")
        inputs.fill_for_warmup(8, runner.kv_pool.num_pages)  # stale rows to be overwritten
        inputs.fill(batch, 5)
        padded = inputs.batch(5)
        got = model.forward(padded, backend, backend.build_metadata(padded), *caches)
    assert got.shape[0] == 5
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    # Unwritten slots hold NaN: a padding row's write would show as a number there, or as a
    # different key over a real slot. (The real rows' K/V differ by matmul rounding only.)
    torch.testing.assert_close(runner.kv_pool.k, pool_after[0], equal_nan=True, atol=1e-5, rtol=0)
    torch.testing.assert_close(runner.kv_pool.v, pool_after[1], equal_nan=True, atol=1e-5, rtol=0)


def test_warm_up_runs_each_reachable_autotuning_key_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (length bucket, direct) decode key and every extend bucket up to the context."""
    from asyncengine.executor.attention import triton_backend as attention_triton
    from asyncengine.kernels.triton import triton_decode_attention

    # Small buckets keep the interpreter quick; the logic is the same at the real sizes.
    monkeypatch.setattr(attention_triton, "CONTEXT_BUCKETS", (32, 64))
    monkeypatch.setattr(attention_triton, "Q_LEN_BUCKETS", (16, 32))
    monkeypatch.setattr(triton_decode_attention, "MIN_TOKENS_PER_SPLIT", 16)
    page_size, max_context = 4, 80
    pool = torch.randn((8 * page_size, 1, 64))
    runs = attention_triton.TritonBackend().warm_up(
        pool, pool.clone(), num_heads=3, page_size=page_size, max_batch_size=4,
        max_context=max_context,
    )  # fmt: skip
    decode_keys = [r.key for r in runs if r.kernel == "decode"]
    extend_keys = [r.key[0] for r in runs if r.kernel == "extend"]
    assert len(set(decode_keys)) == len(decode_keys)
    assert len(set(extend_keys)) == len(extend_keys)
    # A context of one page is one split (direct); longer ones split in every bucket.
    assert set(decode_keys) == {(32, True), (32, False), (64, False), (128, False)}
    assert sorted(extend_keys) == [16, 32, 64]
    assert max(r.length for r in runs) == max_context
