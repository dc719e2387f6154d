"""The int8 product's panels built a row range at a time after start-up
(executor/layers/panel_build.py, ``QuantizedLinear.defer_i8``, ``LlamaModel.defer_panels``):
the ranges pack the bytes one call packs; a projection whose panels are on their way answers
few-row calls by the quantized product and many-row ones by finishing its panels now, never
packing a range twice nor holding more than one set of panels; the budget is asked once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from asyncengine.executor.layers import linear as linear_module
from asyncengine.executor.layers import panel_build
from asyncengine.executor.layers.linear import DenseBudget, QuantizedLinear
from asyncengine.executor.layers.panel_build import PanelBuild
from asyncengine.kernels.cpu import quant_i8gemm_native
from asyncengine.kernels.cpu.quant_native import interleave
from asyncengine.kernels.quant_formats import FORMATS
from tests.kernels.test_quantized_kernels import random_weight
from tests.native_support import needs_native

pytestmark = [
    needs_native,
    pytest.mark.usefixtures("without_amx"),  # the int8 product's paths where AMX would take them
]
needs_fast = pytest.mark.skipif(
    not quant_i8gemm_native.available(), reason="this CPU has no AVX-512 VNNI int8 product"
)
DEFERRED_ROWS = linear_module.I8_DEFERRED_ROWS


def _counting_pack(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows handed to ``pack``, call by call (every range the builds pack)."""
    packed: list[int] = []
    pack = quant_i8gemm_native.pack

    def counted(weight: Any, out: Any = None) -> Any:
        packed.append(weight.shape[0])
        return pack(weight, out)

    monkeypatch.setattr(quant_i8gemm_native, "pack", counted)
    return packed


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_ranges_pack_the_bytes_of_one_call(name: str, interleaved: bool) -> None:
    """Rows past the last whole panel and past the last interleaved group included."""
    for rows, unit_bytes in ((53, 1), (53, 10**9), (77, 40_000)):
        weight = random_weight(FORMATS[name], rows, 512, seed=rows)
        if interleaved:
            weight = interleave(weight)
        build = PanelBuild([weight], unit_bytes)
        assert build.nbytes == quant_i8gemm_native.packed_bytes(weight)
        steps = 0
        while not build.done:
            build.step()
            steps += 1
        if unit_bytes == 1:  # one panel a range
            assert steps == -(-rows // quant_i8gemm_native.PANEL_COLUMNS)
        (panels,) = build.finish()
        whole = quant_i8gemm_native.pack(weight)
        assert (panels.rows, panels.cols) == (whole.rows, whole.cols)
        assert torch.equal(panels.data, whole.data)


def test_panels_are_written_only_where_they_fit() -> None:
    weight = random_weight(FORMATS["Q4_K"], 32, 256, seed=1)
    room = quant_i8gemm_native.empty_panels(weight)
    with pytest.raises(ValueError, match="panels"):
        quant_i8gemm_native.pack(weight, room.data[:1])


def _mixed(budget: DenseBudget | None = None) -> QuantizedLinear:
    """A q/k/v-like projection of two K formats (two parts), with a bias."""
    q4 = random_weight(FORMATS["Q4_K"], 40, 512, seed=2)
    q6 = random_weight(FORMATS["Q6_K"], 24, 512, seed=3)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(4))
    return QuantizedLinear([q4, q6], bias, dense_from_rows=8, budget=budget)


@needs_fast
def test_a_deferred_projection_answers_by_the_quantized_product_until_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed = _counting_pack(monkeypatch)
    monkeypatch.setattr(panel_build, "UNIT_BYTES", 1)  # a panel a range
    lazy, deferred = _mixed(), _mixed()
    assert deferred.defer_i8(torch.bfloat16) and deferred.defer_i8(torch.bfloat16)  # one build
    x = torch.randn(16, 512).to(torch.bfloat16)
    assert torch.equal(deferred(x), deferred._quantized(x))
    assert deferred._i8 is None and deferred._dense is None and not packed
    steps = 0
    while deferred.i8_deferred:
        deferred.build_i8_step()
        steps += 1
        if deferred.i8_deferred:  # half built: still the quantized product
            assert torch.equal(deferred(x), deferred._quantized(x))
    assert steps == 3 + 2 and sum(packed) == 64  # 40 rows in 3 panels, 24 in 2: each once
    assert not deferred.defer_i8(torch.bfloat16)  # built: nothing more to defer
    deferred.build_i8_step()  # a step past the end does nothing
    assert sum(packed) == 64
    assert torch.equal(deferred(x), lazy(x))  # the panels one build makes, the int8 product
    assert lazy._i8 is not None and deferred._i8 is not None
    for mine, theirs in zip(deferred._i8, lazy._i8, strict=True):
        assert torch.equal(mine.data, theirs.data)
    assert deferred._dense is None


@needs_fast
def test_a_call_past_the_deferred_rows_finishes_the_build_without_packing_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed = _counting_pack(monkeypatch)
    monkeypatch.setattr(panel_build, "UNIT_BYTES", 1)
    lazy, deferred = _mixed(), _mixed()
    assert deferred.defer_i8(torch.bfloat16)
    deferred.build_i8_step()
    assert packed == [16] and deferred.i8_deferred
    x = torch.randn(16, 512).to(torch.bfloat16)
    for _ in range(DEFERRED_ROWS // 16 - 1):  # the quantized product up to its rows in all
        assert torch.equal(deferred(x), deferred._quantized(x))
    assert deferred.i8_deferred and packed == [16]
    assert torch.equal(deferred(x), lazy(x))  # the call that reaches them packs the rest
    assert not deferred.i8_deferred and deferred._dense is None
    assert sum(packed) == 64 + 64  # the deferred build's rows once, the lazy one's once
    deferred.build_i8_step()
    assert sum(packed) == 128


@needs_fast
def test_the_budget_is_asked_once_and_a_refusal_ends_the_build() -> None:
    refused = _mixed(DenseBudget(0))
    assert refused.defer_i8(torch.bfloat16)
    refused.build_i8_step()
    assert not refused.i8_deferred and refused._i8 is None and refused._i8_below == 0
    x = torch.randn(16, 512)
    assert torch.equal(refused(x), refused._quantized(x))  # no dense copy either: no room
    room = sum(quant_i8gemm_native.packed_bytes(p) for p in refused.parts)
    budget = DenseBudget(room)
    taken = _mixed(budget)
    assert taken.defer_i8(torch.bfloat16)
    while taken.i8_deferred:
        taken.build_i8_step()
    assert taken._i8 is not None and budget.left == 0


@needs_fast
def test_the_model_builds_every_projection_in_step_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LlamaModel.defer_panels`` over a model's projections, one of them built by a forward's
    call meanwhile: each built once, the rest in step order, then nothing left."""
    from asyncengine.executor.layers.model import LlamaModel

    order: list[int] = []
    step_of = linear_module.QuantizedLinear.build_i8_step

    def recorded(self: QuantizedLinear) -> None:
        order.append(id(self))
        step_of(self)

    monkeypatch.setattr(linear_module.QuantizedLinear, "build_i8_step", recorded)
    layers = [_mixed() for _ in range(3)]
    model = LlamaModel.__new__(LlamaModel)
    model.layers = [_Layer(a) for a in layers]  # type: ignore[list-item]
    model.lm_head = _mixed()
    model.dtype = torch.bfloat16
    work = model.defer_panels()
    assert work is not None
    layers[1](torch.randn(DEFERRED_ROWS, 512))  # a long prompt's call packs this one now
    calls = 0
    while work():
        calls += 1
    everything = [*layers, model.lm_head]
    assert all(p._i8 is not None and not p.i8_deferred for p in everything)
    firsts = list(dict.fromkeys(order))
    assert firsts == [id(p) for p in everything if p is not layers[1]]
    assert model.defer_panels() is None


class _Layer:
    """A layer whose four projections are one (the model's walk asks each)."""

    def __init__(self, projection: QuantizedLinear) -> None:
        self.qkv = self.o_proj = self.gate_up = self.down = projection


@needs_fast
async def test_the_engine_builds_them_on_its_worker_between_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine runs the deferred work on the forward's thread, a piece per call, while it
    serves; a stop under way ends it cleanly."""
    from asyncengine.api.engine import AsyncEngine
    from asyncengine.common.sampling_params import SamplingParams
    from tests.api.test_engine_loop import CharTokenizer, fake_engine
    from tests.fake_executor import FakeExecutor

    projection = _mixed()
    threads: set[str] = set()
    step_of = linear_module.QuantizedLinear.build_i8_step

    def recorded(self: QuantizedLinear) -> None:
        threads.add(threading.current_thread().name)
        step_of(self)

    monkeypatch.setattr(linear_module.QuantizedLinear, "build_i8_step", recorded)
    monkeypatch.setattr(panel_build, "UNIT_BYTES", 1)

    def defer() -> Any:
        assert projection.defer_i8(torch.bfloat16)

        def work() -> bool:
            projection.build_i8_step()
            return projection.i8_deferred

        return work

    executor = FakeExecutor(256)
    executor.defer_one_time_work = defer  # type: ignore[attr-defined]
    engine: AsyncEngine = fake_engine()
    engine._given = (executor, CharTokenizer())
    async with engine:
        out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
        assert len(out.token_ids) == 4
        assert engine._one_time_task is not None
        await engine.one_time_work_done()
    assert projection._i8 is not None
    assert threads and all(name.startswith("asyncengine-forward") for name in threads)
    stopped = _mixed()
    executor = FakeExecutor(256)
    executor.defer_one_time_work = lambda: lambda: stopped.defer_i8(torch.bfloat16)  # type: ignore[attr-defined]
    engine = fake_engine()
    engine._given = (executor, CharTokenizer())
    async with engine:  # endless work: the stop cancels it
        pass
    assert engine._one_time_task is None


@pytest.mark.parametrize(
    ("names", "rows", "sets"),
    [
        (["Q5_0", "Q5_0", "Q8_0"], [32, 16, 24], [[0, 1, 2]]),  # a q / k / v of one family
        (["Q4_0", "Q8_0"], [16, 40], [[0, 1]]),
        (["Q5_1", "Q4_1"], [48, 8], [[0, 1]]),
        (["Q5_0", "Q8_0"], [40, 16], [[0], [1]]),  # the first ends inside a panel
        (["Q8_0", "Q4_1", "Q5_1"], [16, 16, 16], [[0], [1, 2]]),  # a min or not: two families
        (["Q4_K", "Q6_K"], [32, 32], [[0], [1]]),
    ],
)
def test_parts_of_one_panel_family_share_one_panel_set(
    names: list[str], rows: list[int], sets: list[list[int]]
) -> None:
    """Their panels are each part's, one after another: the bytes ``pack`` makes of each."""
    shapes = enumerate(zip(names, rows, strict=True))
    parts = [random_weight(FORMATS[name], n, 512, seed=i) for i, (name, n) in shapes]
    assert panel_build.panel_sets(parts) == sets
    for unit_bytes in (1, None):
        panels = PanelBuild(parts, unit_bytes).finish()
        assert [p.rows for p in panels] == [sum(rows[i] for i in members) for members in sets]
        for members, built in zip(sets, panels, strict=True):
            whole = torch.cat([quant_i8gemm_native.pack(parts[i]).data for i in members])
            assert torch.equal(built.data, whole)


@needs_fast
def test_a_projection_of_one_panel_family_is_one_int8_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Q5_0 q / k beside a Q8_0 v (llama-quantize's Q4_K_M at 896-wide rows): one call, the
    activations quantized once, the same values as a call per part."""
    parts = [
        random_weight(FORMATS["Q5_0"], 64, 896, seed=1),
        random_weight(FORMATS["Q5_0"], 16, 896, seed=2),
        random_weight(FORMATS["Q8_0"], 16, 896, seed=3),
    ]
    bias = torch.randn(96, generator=torch.Generator().manual_seed(4))
    projection = QuantizedLinear(parts, bias, dense_from_rows=8)
    x = torch.randn(32, 896, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    calls: list[int] = []
    linear = quant_i8gemm_native.linear

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[1].rows)
        return linear(*args, **kwargs)

    monkeypatch.setattr(quant_i8gemm_native, "linear", counted)
    got = projection(x)
    assert calls == [96]
    per_part = torch.cat(
        [linear(x, quant_i8gemm_native.pack(p), bias[s : s + p.shape[0]]) for p, s in
         zip(parts, (0, 64, 80), strict=True)],
        dim=1,
    )  # fmt: skip
    assert torch.equal(got, per_part)
