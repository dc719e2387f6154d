"""A CPU forward's MLP over row chunks (``LlamaModel._mlp``, ``MLP_CHUNK_BYTES``): equal chunks
whose gate/up output stays within the bound, the rows the same as in one call (each row's sums
run in the same order whatever the other rows: the native row kernels below their dense
crossover), odd row counts included; a step within the bound is one call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncengine.executor.layers import model as model_module
from asyncengine.executor.layers.model import LlamaModel
from asyncengine.executor.layers.model_config import ModelConfig
from tests.conftest import TinyCheckpoint


def test_chunks_give_the_rows_of_one_call(
    tiny_llama: TinyCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ModelConfig.from_hf_dict(tiny_llama.hf_config)
    model = LlamaModel(config, dict(tiny_llama.load_weights()), torch.float32)
    layer = model.layers[1]
    row_bytes = model.gate_up_row_bytes
    assert row_bytes == 2 * config.intermediate_size * 4
    calls: list[int] = []
    gate_up = layer.gate_up

    def counted(x: torch.Tensor) -> Any:
        calls.append(x.shape[0])
        return gate_up(x)

    layer.gate_up = counted  # type: ignore[assignment]
    for rows, bound_rows, want in ((11, 4, [4, 4, 3]), (10, 4, [4, 4, 2]), (7, 7, [7])):
        monkeypatch.setattr(model_module, "MLP_CHUNK_BYTES", bound_rows * row_bytes)
        x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
        calls.clear()
        got = model._mlp(layer, x)
        assert calls == want and max(calls) <= bound_rows
        whole = layer.down(model.act_and_mul(gate_up(x)))
        assert torch.equal(got, whole)
