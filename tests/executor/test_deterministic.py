"""Deterministic mode's parts: a row's result is the same bits whatever shares its call.

- matmuls on fixed-shape row blocks: the same row alone, at any position of any batch;
- attention (the native extend kernel for every query, or torch's with keys padded to fixed
  blocks): a query row alone, in a chunk after a cached prefix, beside other requests of any
  length, or as a decode, gives the same output.

These are properties of the kernels on the machine that runs them (the point of the mode), so
they are checked here on the model's own shapes and on the pool's own layout. The end-to-end
check (the same requests alone and under load) is tests/executor/test_deterministic_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from asyncengine.executor.attention.invariant import (
    KEY_BLOCK,
    KeyBuffers,
    invariant_attention,
    padded_keys,
    padded_queries,
    plan_invariant,
)
from asyncengine.executor.attention.invariant_native import plan_invariant_native
from asyncengine.executor.forward_batch import ForwardBatch
from asyncengine.executor.layers.linear import ROW_BLOCK, Linear, QuantizedLinear
from asyncengine.executor.layers.model import LlamaModel
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.kernels.cpu.attention_native import extend_kernel_runs, native_extend_attention
from asyncengine.kernels.quant_formats import FORMATS, QuantizedTensor
from asyncengine.kernels.reference.kv_int8_ref import quantize_kv
from asyncengine.kernels.reference.norm_ref import fused_add_rms_norm, rms_norm
from tests.kernels.test_quant_i8gemm import needs_k_format_i8
from tests.kernels.test_quantized_kernels import random_weight

DTYPES = [torch.bfloat16, torch.float32]

# SmolLM2-135M's matmuls (qkv, o, gate_up, down, a slice of the LM head)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("packed", ["1", "0"])
def test_row_blocked_linear_rows_do_not_depend_on_the_batch(
    dtype: torch.dtype, n: int, k: int, packed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both matmul paths: oneDNN's prepacked weights and plain ``F.linear``."""
    monkeypatch.setenv("ASYNCENGINE_PACKED_LINEAR", packed)
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    fixed_block_linear = Linear(weight, row_block=ROW_BLOCK)
    x = torch.randn(300, k, generator=gen).to(dtype)
    probe = list(range(0, 300, 23))
    alone = {i: fixed_block_linear(x[i : i + 1])[0] for i in probe}
    for size in (2, ROW_BLOCK - 1, ROW_BLOCK, ROW_BLOCK + 1, 7 * ROW_BLOCK + 3, 300):
        for offset in (0, 5):
            rows = x[offset : offset + size]
            out = fixed_block_linear(rows)
            assert out.shape == (rows.shape[0], n)
            for i in probe:
                if offset <= i < offset + rows.shape[0]:
                    assert torch.equal(out[i - offset], alone[i]), (size, offset, i)
    # and it is the product it claims to be
    torch.testing.assert_close(
        fixed_block_linear(x).float(), (x.float() @ weight.float().T), atol=0.5, rtol=0.05
    )


def _k_format_llama() -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor]]:
    """One layer of whole super-blocks (hidden 256) in Q4_K_M's formats, random blocks."""
    config = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        }
    )
    q4, q6 = FORMATS["Q4_K"], FORMATS["Q6_K"]
    p = "model.layers.0."
    shapes = {
        p + "self_attn.q_proj.weight": (q4, 256, 256),
        p + "self_attn.k_proj.weight": (q4, 128, 256),
        p + "self_attn.v_proj.weight": (q6, 128, 256),
        p + "self_attn.o_proj.weight": (q4, 256, 256),
        p + "mlp.gate_proj.weight": (q4, 512, 256),
        p + "mlp.up_proj.weight": (q4, 512, 256),
        p + "mlp.down_proj.weight": (q6, 256, 512),
        "lm_head.weight": (q6, 320, 256),
    }
    weights: dict[str, torch.Tensor | QuantizedTensor] = {
        name: random_weight(fmt, rows, cols, seed=i)
        for i, (name, (fmt, rows, cols)) in enumerate(shapes.items())
    }
    weights["model.embed_tokens.weight"] = torch.randn(320, 256) * 0.1
    for name in (
        p + "input_layernorm.weight",
        p + "post_attention_layernorm.weight",
        "model.norm.weight",
    ):
        weights[name] = torch.ones(256)
    return config, weights


@needs_k_format_i8
def test_quantized_projections_take_the_int8_product_built_from_the_written_weights() -> None:
    """A deterministic model's K-format projections (their parts in the model's weight arena,
    written only once every projection is made) build their int8 panels when the runner asks,
    after that: the panels give the group kernels' products of the same weights (within the
    activations' rounding), for one row and for many."""
    config, weights = _k_format_llama()
    model = LlamaModel(config, weights, torch.float32, row_block=ROW_BLOCK)
    layer = model.layers[0]
    projections = [layer.qkv, layer.o_proj, layer.gate_up, layer.down, model.lm_head]
    assert all(isinstance(p, QuantizedLinear) and p._i8 is None for p in projections)
    model.build_i8_every_row()  # the runner's start-up
    for projection in projections:
        assert isinstance(projection, QuantizedLinear) and projection._i8 is not None
        for n in (1, 40):
            x = torch.randn(n, projection.in_features, generator=torch.Generator().manual_seed(n))
            got, group = projection(x), projection._quantized(x)
            assert float((got - group).norm() / group.norm()) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_work_row_by_row_on_the_cpu(dtype: torch.dtype) -> None:
    """Why deterministic mode leaves the CPU norms alone."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    residual = torch.randn(300, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    whole = rms_norm(x, weight, 1e-5)
    fused, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    for i in (0, 1, 150, 299):
        assert torch.equal(rms_norm(x[i : i + 1], weight, 1e-5)[0], whole[i])
        one, one_sum = fused_add_rms_norm(x[i : i + 1], residual[i : i + 1], weight, 1e-5)
        assert torch.equal(one[0], fused[i]) and torch.equal(one_sum[0], summed[i])


# ----------------------------------------------------------------------------- attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
MAX_LEN = 1100


@dataclass
class Pool:
    """K/V of a few requests in shuffled pages (unused slots NaN), and each request's query at
    each position (so that a row has the same query in every arrangement)."""

    k: torch.Tensor
    v: torch.Tensor
    tables: dict[str, list[int]]
    queries: dict[str, torch.Tensor]


def make_pool(dtype: torch.dtype, lengths: dict[str, int]) -> Pool:
    """int8: a float32 pool's rows quantized (kv_int8_ref.py), float32 queries."""
    if dtype == torch.int8:
        wide = make_pool(torch.float32, lengths)
        k, v = quantize_kv(wide.k), quantize_kv(wide.v)
        return Pool(k, v, wide.tables, wide.queries)
    gen = torch.Generator().manual_seed(11)
    pages_per = -(-MAX_LEN // PAGE)
    num_pages = pages_per * len(lengths) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    k = torch.full((num_pages * PAGE, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v = k.clone()
    tables, queries = {}, {}
    for i, (name, length) in enumerate(lengths.items()):
        pages = order[i * pages_per : (i + 1) * pages_per]
        tables[name] = pages
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(length)])
        k[slots] = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v[slots] = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        queries[name] = torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(dtype) * 2
    return Pool(k, v, tables, queries)


Segment = tuple[str, int, int]  # request, first position, positions (decode: 1 and decode=True)


BACKENDS = ["torch", "native"]


def attend_with(
    pool: Pool,
    extends: list[Segment],
    decodes: list[tuple[str, int]],
    backend: str = "torch",
    window: int = 0,
    softcap: float = 0.0,
) -> dict:
    """Outputs {(request, position): [H, D]} of one forward holding these segments."""
    q, rows, batch = make_batch(pool, extends, decodes)
    if backend == "native":
        native = plan_invariant_native(batch, HEADS, pool.k)
        assert native is not None
        out = native_extend_attention(q, pool.k, pool.v, native, HEAD_DIM**-0.5, window, softcap)
        return {row: out[i] for i, row in enumerate(rows)}
    plan = plan_invariant(batch, pool.k, HEADS)
    # padding rows hold whatever an earlier forward left there: large values here
    buffers = KeyBuffers()
    for stale in buffers.take(plan.key_rows, pool.k):
        stale.fill_(1e4 if stale.is_floating_point() else 100)  # int8: a scale of ~2.5e32
    out = invariant_attention(q, pool.k, pool.v, plan, HEAD_DIM**-0.5, buffers, window, softcap)
    return {row: out[i] for i, row in enumerate(rows)}


def make_batch(
    pool: Pool, extends: list[Segment], decodes: list[tuple[str, int]]
) -> tuple[torch.Tensor, list[tuple[str, int]], ForwardBatch]:
    """The queries, their (request, position) rows and the ForwardBatch of these segments."""
    rows: list[tuple[str, int]] = [(r, s + j) for r, s, n in extends for j in range(n)]
    rows += decodes
    q = torch.stack([pool.queries[r][p] for r, p in rows])
    width = -(-MAX_LEN // PAGE)

    def table(names: list[str]) -> torch.Tensor:
        return torch.tensor([pool.tables[n][:width] for n in names], dtype=torch.int32).view(
            len(names), width
        )

    cu = [0]
    for _, _, n in extends:
        cu.append(cu[-1] + n)
    num = len(rows)
    batch = ForwardBatch(
        input_ids=torch.zeros(num, dtype=torch.int64),
        positions=torch.tensor([p for _, p in rows]),
        slot_mapping=torch.zeros(num, dtype=torch.int64),
        sample_indices=torch.zeros(0, dtype=torch.int64),
        page_size=PAGE,
        num_extend_tokens=cu[-1],
        extend_block_table=table([r for r, _, _ in extends]),
        extend_seq_lens=torch.tensor([s + n for _, s, n in extends], dtype=torch.int32),
        extend_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        extend_max_q_len=max((n for _, _, n in extends), default=0),
        extend_max_seq_len=max((s + n for _, s, n in extends), default=0),
        decode_block_table=table([r for r, _ in decodes]),
        decode_seq_lens=torch.tensor([p + 1 for _, p in decodes], dtype=torch.int32),
        decode_max_seq_len=max((p + 1 for _, p in decodes), default=0),
    )
    return q, rows, batch


# (backend, sliding window, soft-cap): Gemma 2/3 layers as well as plain ones
OPTIONS = [
    ("torch", 0, 0.0),
    ("native", 0, 0.0),
    ("torch", 100, 0.0),
    ("torch", 100, 3.0),
    ("torch", 0, 3.0),
    ("native", 100, 3.0),
]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.int8])
@pytest.mark.parametrize(("backend", "window", "softcap"), OPTIONS)
def test_attention_rows_do_not_depend_on_batch_chunking_or_prefix(
    dtype: torch.dtype, backend: str, window: int, softcap: float
) -> None:
    pool = make_pool(dtype, {"a": 300, "b": 700, "c": 90, "d": 40, "e": 1050})
    if backend == "native" and not extend_kernel_runs():
        # no AVX-512 build: deterministic mode must then choose the torch backend
        assert plan_invariant_native(make_batch(pool, [("a", 0, 1)], [])[2], HEADS, pool.k) is None
        return

    def attend(pool: Pool, extends: list[Segment], decodes: list[tuple[str, int]]) -> dict:
        return attend_with(pool, extends, decodes, backend, window, softcap)

    alone = attend(pool, [("a", 0, 300)], [])
    assert all(torch.isfinite(row).all() for row in alone.values())
    arrangements = {
        "chunks": [
            attend(pool, [("a", 0, 100)], []),
            attend(pool, [("a", 100, 150)], []),
            attend(pool, [("a", 250, 50)], []),
        ],
        # chunk lengths whose rows (3 query heads per KV head) end in each short last block
        "short chunks": [
            attend(pool, [("a", start, n)], [])
            for start, n in (
                (0, 1),
                (1, 2),
                (3, 3),
                (6, 4),
                (10, 5),
                (15, 11),
                (26, 22),
                (48, 43),
                (91, 33),
                (124, 34),
                (158, 35),
            )
        ]
        + [attend(pool, [("a", 193, 65), ("c", 0, 66)], []), attend(pool, [("a", 258, 42)], [])],
        "batched": [
            attend(
                pool,
                [("b", 0, 700), ("a", 0, 300), ("c", 50, 40)],
                [("d", 39), ("e", 1049)],
            )
        ],
        "after a cached prefix, with others": [
            attend(pool, [("c", 0, 90), ("a", 200, 100)], [("e", 600)]),
        ],
        "as decodes": [
            attend(pool, [], [("a", 299), ("a", 17)]),
            attend(pool, [("b", 0, 20)], [("e", 1000), ("a", 150), ("d", 39)]),
        ],
    }
    for name, outputs in arrangements.items():
        for out in outputs:
            for (req, pos), row in out.items():
                if req == "a":
                    assert torch.equal(row, alone[("a", pos)]), (name, pos)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_query_padding_avoids_short_last_blocks_in_float32(group: int) -> None:
    lengths = range(1, 300)
    padded = [padded_queries(n, group, torch.float32) for n in lengths]
    assert all(
        p >= n and (p * group) % 32 not in (1, 2, 3) for n, p in zip(lengths, padded, strict=True)
    )
    assert all(p - n < 4 for n, p in zip(lengths, padded, strict=True))
    assert [padded_queries(n, group, torch.bfloat16) for n in lengths] == list(lengths)


def test_keys_are_padded_to_whole_blocks() -> None:
    assert [padded_keys(n) for n in (1, KEY_BLOCK, KEY_BLOCK + 1)] == [
        KEY_BLOCK,
        KEY_BLOCK,
        2 * KEY_BLOCK,
    ]


@pytest.mark.parametrize(("backend", "window", "softcap"), [*OPTIONS, ("torch", 7, 0.0)])
def test_invariant_attention_is_attention(backend: str, window: int, softcap: float) -> None:
    """Against a plain float64 softmax(q k^T) v over each row's visible keys (the last
    ``window`` of them; scores soft-capped)."""
    pool = make_pool(torch.float32, {"a": 60, "b": 30})
    if backend == "native" and not extend_kernel_runs():
        return  # the first test checks that the torch backend is chosen then
    window = min(window, 13)  # windows that cut these short requests
    out = attend_with(pool, [("a", 20, 40)], [("b", 29)], backend, window, softcap)
    for (req, pos), row in out.items():
        first = max(0, pos + 1 - window) if window else 0
        slots = torch.tensor(
            [pool.tables[req][p // PAGE] * PAGE + p % PAGE for p in range(first, pos + 1)]
        )
        k = pool.k[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
        v = pool.v[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        q = pool.queries[req][pos].double()  # [H, D]
        scores = torch.einsum("hd,lhd->hl", q, k) * HEAD_DIM**-0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.softmax(scores, dim=-1)
        expected = torch.einsum("hl,lhd->hd", weights, v)
        torch.testing.assert_close(row.double(), expected, atol=1e-5, rtol=1e-5)
