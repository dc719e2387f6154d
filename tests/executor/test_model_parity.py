"""The executor's logits against Hugging Face transformers (the oracle) on tiny checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.cache.page_table import PageTable
from asyncengine.common.plan import BatchPlan, SamplingInfo, Segment
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.executor import deterministic
from asyncengine.executor.attention import torch_backend as attention
from asyncengine.executor.attention.invariant import InvariantTorchBackend
from asyncengine.executor.attention.torch_backend import TorchBackend
from asyncengine.executor.kv_pool import KVPool
from asyncengine.executor.layers.model_config import ModelConfig
from asyncengine.executor.runner import ModelRunner
from asyncengine.kernels.reference import attention_ref, decode_sparse_ref
from tests.conftest import TinyCheckpoint

MAX_LEN = 64


class Harness:
    """A runner over a pool whose pages are handed out shuffled, so slots interleave."""

    def __init__(
        self,
        ckpt: TinyCheckpoint,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        deterministic: bool = False,
        num_requests: int = 4,
    ) -> None:
        self.config = ModelConfig.from_hf_dict(ckpt.hf_config)
        pages_per_request = -(-MAX_LEN // page_size)
        num_pages = pages_per_request * num_requests + 3
        self.pool = KVPool(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            num_pages,
            page_size,
            dtype,
        )
        self.pool.k.fill_(float("nan"))  # a read of a slot never written poisons the logits
        self.pool.v.fill_(float("nan"))
        self.table = PageTable(num_requests, pages_per_request)
        order = np.random.default_rng(page_size).permutation(num_pages)
        for row in range(num_requests):
            self.table.set_pages(
                row, 0, order[row * pages_per_request : (row + 1) * pages_per_request]
            )
        self.runner = ModelRunner(
            self.config,
            ckpt.load_weights(),
            self.pool,
            self.table,
            dtype,
            deterministic=deterministic,
        )


def hf_logits(ckpt: TinyCheckpoint, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of the whole sequence, no cache."""
    model = ckpt.load_hf_model()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def sampling_for(n: int) -> list[SamplingInfo]:
    return [SamplingInfo(SamplingParams(temperature=0.0), [], []) for _ in range(n)]


def seg(rid: str, row: int, tokens: list[int], start: int, sample: bool = True) -> Segment:
    return Segment(rid=rid, row=row, input_ids=tokens, start_pos=start, sample=sample)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "name",
    [
        "llama_gqa",
        "llama_tied",
        "qwen2_bias",
        "llama3_rope",
        "qwen2_yarn",
        "qwen3_qk_norm",
        "mistral_window",
        "qwen2_window",
        "gemma",
        "gemma2",
        "gemma3",
    ],
)
def test_prefill_extend_and_decode_match_hf(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str, page_size: int
) -> None:
    check_prefill_extend_and_decode(tiny_checkpoints[name], page_size)


def test_decode_in_chunks_of_one_request_matches_hf(
    tiny_llama: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_ref, "DECODE_CHUNK_BYTES", 1)  # bf16 / GPU: gathered chunks
    monkeypatch.setattr(decode_sparse_ref, "SPARSE_DECODE_CHUNK_ENTRIES", 1)  # fp32 on CPU
    check_prefill_extend_and_decode(tiny_llama, page_size=4)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral_window"])
def test_deterministic_mode_matches_hf(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str
) -> None:
    """Sliding windows and soft-caps through deterministic mode's attention (the native extend
    kernel for every query on an AVX-512 CPU, the padded torch attention elsewhere)."""
    check_prefill_extend_and_decode(tiny_checkpoints[name], 16, deterministic=True)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_deterministic_torch_attention_takes_windows_and_soft_caps(
    tiny_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(deterministic, "_native_extend_runs", lambda *args: False)
    h = Harness(tiny_checkpoints[name], 16, deterministic=True)
    assert isinstance(h.runner.backend, InvariantTorchBackend)
    check_prefill_extend_and_decode(tiny_checkpoints[name], 16, deterministic=True)


@pytest.mark.parametrize("decode", ["sparse", "gather"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral_window"])
def test_torch_reference_attention_matches_hf(
    tiny_checkpoints: dict[str, TinyCheckpoint],
    name: str,
    decode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows and soft-caps in the torch references (bucketed extends; float32 decodes in place
    from the pool, or gathered as in bfloat16 and on a GPU), the native kernels off."""
    if decode == "gather":
        monkeypatch.setattr(
            attention,
            "plan_decode",
            lambda table, lens, page_size, heads, k_cache: attention_ref.plan_gather_decode(
                table, lens, page_size, k_cache
            ),
        )
    check_prefill_extend_and_decode(tiny_checkpoints[name], 4, native=False)


def check_prefill_extend_and_decode(
    ckpt: TinyCheckpoint, page_size: int, deterministic: bool = False, native: bool = True
) -> None:
    """Prefills, a chunked prefill, an extend on a cached prefix and decodes, against HF.
    ``native=False``: the torch attention references even where the native kernels run."""
    h = Harness(ckpt, page_size, deterministic=deterministic)
    if not native:
        assert isinstance(h.runner.backend, TorchBackend)
        h.runner.backend.native = False
    rng = np.random.default_rng(7)
    vocab = h.config.vocab_size
    lengths = {"a": 5, "b": 23, "c": 17}  # c: a 12-token chunk first, then 5 on top of it
    full = {rid: rng.integers(3, vocab, MAX_LEN).tolist() for rid in lengths}
    expected = {rid: hf_logits(ckpt, toks) for rid, toks in full.items()}
    row = {"a": 0, "b": 1, "c": 2}

    def check(logits: torch.Tensor, at: list[tuple[str, int]]) -> None:
        want = torch.stack([expected[rid][pos] for rid, pos in at])
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)

    # Step 1: two prefills and the first chunk of c (not sampled: a chunk mid-prefill).
    plan = BatchPlan(
        step=1,
        extends=[
            seg("a", row["a"], full["a"][:5], 0),
            seg("c", row["c"], full["c"][:12], 0, sample=False),
            seg("b", row["b"], full["b"][:23], 0),
        ],
    )
    check(h.runner.forward_logits(plan), [("a", 4), ("b", 22)])

    # Step 2: c extends on its cached prefix (ends mid-page at 16) beside two decodes.
    plan = BatchPlan(
        step=2,
        extends=[seg("c", row["c"], full["c"][12:17], 12)],
        decodes=[seg("a", row["a"], [full["a"][5]], 5), seg("b", row["b"], [full["b"][23]], 23)],
    )
    check(h.runner.forward_logits(plan), [("c", 16), ("a", 5), ("b", 23)])

    # Steps 3..6: decodes of all three, different lengths in one batch.
    pos = {"a": 6, "b": 24, "c": 17}
    for step in range(3, 7):
        decodes = [seg(rid, row[rid], [full[rid][p]], p) for rid, p in pos.items()]
        check(h.runner.forward_logits(BatchPlan(step=step, decodes=decodes)), list(pos.items()))
        pos = {rid: p + 1 for rid, p in pos.items()}


def test_execute_samples_greedily_from_the_logits_in_plan_order(tiny_llama: TinyCheckpoint) -> None:
    h = Harness(tiny_llama, page_size=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    plan = BatchPlan(
        step=1,
        extends=[seg("x", 0, prompts[0], 0), seg("y", 1, prompts[1], 0)],
        sampling=sampling_for(2),
    )
    out = h.runner.execute(plan)
    want = [int(hf_logits(tiny_llama, p)[-1].argmax()) for p in prompts]
    assert out.token_ids == want
    assert out.logprobs == [None, None]
    assert out.forward_seconds > 0


def test_execute_refuses_a_plan_whose_sampling_does_not_match(tiny_llama: TinyCheckpoint) -> None:
    h = Harness(tiny_llama, page_size=4)
    plan = BatchPlan(step=1, extends=[seg("x", 0, [5, 6, 7], 0)], sampling=[])
    with pytest.raises(ValueError, match="samples 1 segments but carries 0"):
        h.runner.execute(plan)


def test_empty_plan_gives_no_logits(tiny_llama: TinyCheckpoint) -> None:
    h = Harness(tiny_llama, page_size=4)
    logits = h.runner.forward_logits(BatchPlan(step=1))
    assert logits.shape == (0, h.config.vocab_size)
    assert h.runner.execute(BatchPlan(step=1)).token_ids == []


def test_bfloat16_tracks_float32(tiny_llama: TinyCheckpoint) -> None:
    tokens = list(range(3, 40))
    plan = BatchPlan(step=1, extends=[seg("x", 0, tokens, 0)])
    want = Harness(tiny_llama, page_size=16).runner.forward_logits(plan)
    got = Harness(tiny_llama, page_size=16, dtype=torch.bfloat16).runner.forward_logits(plan)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_float16_on_cpu_is_refused(tiny_llama: TinyCheckpoint) -> None:
    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="float16 is refused on CPU"):
        ModelRunner(config, tiny_llama.load_weights(), pool, PageTable(2, 2), torch.float16)


def test_pool_of_another_dtype_is_refused(tiny_llama: TinyCheckpoint) -> None:
    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="does not fit the model"):
        ModelRunner(config, tiny_llama.load_weights(), pool, PageTable(2, 2), "bfloat16")


def test_missing_weight_is_named(tiny_llama: TinyCheckpoint) -> None:
    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 4, 4, torch.float32)
    weights = tiny_llama.load_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        ModelRunner(config, weights, pool, PageTable(2, 2), torch.float32)


def test_sequence_past_the_model_length_is_refused(tiny_llama: TinyCheckpoint) -> None:
    h = Harness(tiny_llama, page_size=16)
    too_far = h.config.max_model_len
    plan = BatchPlan(step=1, decodes=[seg("x", 0, [5], too_far)])
    with pytest.raises(ValueError, match="past the model's"):
        h.runner.forward_logits(plan)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_lone_prefill_then_decode_matches_hf(
    tiny_checkpoints: dict[str, TinyCheckpoint], name: str
) -> None:
    ckpt = tiny_checkpoints[name]
    h = Harness(ckpt, page_size=16)
    tokens = np.random.default_rng(3).integers(3, h.config.vocab_size, 40).tolist()
    want = hf_logits(ckpt, tokens)
    logits = h.runner.forward_logits(BatchPlan(step=1, extends=[seg("x", 0, tokens[:39], 0)]))
    torch.testing.assert_close(logits[0], want[38], rtol=0, atol=1e-4)
    logits = h.runner.forward_logits(BatchPlan(step=2, decodes=[seg("x", 0, [tokens[39]], 39)]))
    torch.testing.assert_close(logits[0], want[39], rtol=0, atol=1e-4)
