"""The FlashInfer backend's page layout (CPU) and the backend against the torch one (CUDA with
flashinfer installed; scripts/gpu_check.sh runs the same comparison and times it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from asyncengine.executor.attention.flashinfer_backend import paged_kv_layout

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_layout_takes_each_rows_live_pages_only() -> None:
    page_size = 4
    table = torch.tensor([[7, 3, 9, 0], [5, 0, 0, 0], [1, 2, 6, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 4, 16], dtype=torch.int32)  # 3, 1 and 4 pages
    layout = paged_kv_layout(table, seq_lens, page_size)
    assert layout.indptr.tolist() == [0, 3, 4, 8]
    assert layout.indices.tolist() == [7, 3, 9, 5, 1, 2, 6, 8]
    assert layout.last_page_len.tolist() == [1, 4, 4]
    assert {layout.indptr.dtype, layout.indices.dtype, layout.last_page_len.dtype} == {torch.int32}


def test_layout_of_random_tables_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    page_size = 16
    for _ in range(20):
        batch, width = int(torch.randint(1, 9, (1,), generator=gen)), 6
        table = torch.randint(0, 100, (batch, width), generator=gen, dtype=torch.int32)
        seq_lens = torch.randint(1, width * page_size + 1, (batch,), generator=gen)
        layout = paged_kv_layout(table, seq_lens, page_size)
        expected: list[int] = []
        for row, length in zip(table.tolist(), seq_lens.tolist(), strict=True):
            pages = -(-length // page_size)
            expected += row[:pages]
        assert layout.indices.tolist() == expected
        assert layout.indptr[-1].item() == len(expected)
        lasts = [(n - 1) % page_size + 1 for n in seq_lens.tolist()]
        assert layout.last_page_len.tolist() == lasts


@pytest.mark.gpu
def test_flashinfer_matches_the_torch_backend() -> None:
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs CUDA and flashinfer-python")
    spec = importlib.util.spec_from_file_location("_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    worst = module.compare_backends("cuda", torch.bfloat16, cases=6, seed=0)
    assert worst < 2e-2


# --- the backend's calls, against a stand-in for the flashinfer module -----------------------


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """q [n, H, D] as the last n of the keys' positions; k/v [L, Hkv, D] -> [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k.float()) * scale
    if causal:
        n, length = q.shape[0], k.shape[0]
        allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.float()).to(q.dtype)


class _FakeWrapper:
    """Plans and runs like FlashInfer's paged wrappers (the parameter names the backend passes
    are FlashInfer 0.3's), computing with dense torch attention."""

    causal_default = False

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **kwargs: object) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.planned: dict[str, object] | None = None

    def _plan(self, qo_indptr: torch.Tensor | None, indptr: torch.Tensor, indices: torch.Tensor,
              last_page_len: torch.Tensor, page_size: int, causal: bool, window_left: int,
              logits_soft_cap: float | None, sm_scale: float) -> None:  # fmt: skip
        assert window_left == -1 and logits_soft_cap is None  # plain attention only here
        self.planned = {"qo": qo_indptr, "indptr": indptr, "indices": indices,
                        "last": last_page_len, "page_size": page_size, "causal": causal,
                        "scale": sm_scale}  # fmt: skip

    def run(self, q: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
        p = self.planned
        assert p is not None
        k_pages, v_pages = paged
        indptr, indices, last = p["indptr"], p["indices"], p["last"]
        qo = p["qo"] if p["qo"] is not None else torch.arange(len(indptr))
        for i in range(len(indptr) - 1):
            pages = indices[indptr[i] : indptr[i + 1]]
            length = (len(pages) - 1) * p["page_size"] + int(last[i])
            k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:length]
            v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:length]
            rows = slice(int(qo[i]), int(qo[i + 1]))
            out[rows] = _dense_attention(q[rows], k, v, p["scale"], p["causal"])
        return out


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, window_left=-1,
             logits_soft_cap=None, sm_scale=None, q_data_type="float16", kv_data_type=None):  # type: ignore[no-untyped-def]  # fmt: skip
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   page_size, causal, window_left, logits_soft_cap, sm_scale)  # fmt: skip


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, sm_scale=None):  # type: ignore[no-untyped-def]  # fmt: skip
        self._plan(None, indptr, indices, last_page_len, page_size, False, window_left,
                   logits_soft_cap, sm_scale)  # fmt: skip


def test_backend_calls_match_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FlashInfer backend's layout, plans, cache views and output slices, run through a
    stand-in module on CPU, give the torch backend's outputs on mixed batches."""
    import sys
    import types

    from asyncengine.executor.attention import flashinfer_backend as attention_flashinfer
    from asyncengine.executor.attention.torch_backend import TorchBackend
    from asyncengine.executor.forward_batch import build_forward_batch

    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill  # type: ignore[attr-defined]
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(attention_flashinfer, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(
        "asyncengine.kernels.triton.triton_kv_store.store_kv",
        __import__("asyncengine.kernels.reference.kv_store_ref", fromlist=["store_kv"]).store_kv,
    )
    spec = importlib.util.spec_from_file_location("_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    gen = torch.Generator().manual_seed(1)
    backend = attention_flashinfer.FlashInferBackend("cpu")
    for case in range(6):
        plan, table = script._random_batch(gen, case % 3, case + (case % 3 == 0), 4, 64)
        fb = build_forward_batch(plan, table, 4, torch.device("cpu"))
        n = fb.num_tokens
        q = torch.randn(n, 6, 8, generator=gen)
        k, v = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen)
        caches = torch.randn(256, 2, 8, generator=gen), torch.randn(256, 2, 8, generator=gen)
        outs = []
        for b in (TorchBackend(native=False), backend):
            kc, vc = caches[0].clone(), caches[1].clone()
            outs.append(b.forward(q, k, v, kc, vc, b.build_metadata(fb), 0.35))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
