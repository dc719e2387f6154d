"""The compiled core (mypyc; make setup runs scripts/build_native.py) is the one in use when it
was built, and was built from the sources as they are: an edited ``.py`` whose stale ``.so``
still shadows it fails here (run ``make setup``) instead of quietly running the old code."""

from __future__ import annotations

import ast
import dataclasses
import importlib

import pytest

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.compiled import (
    COMPILED_MODULES,
    build_record,
    compiled_now,
    core_kind,
    extension_path,
    source_path,
    stale_modules,
)


def test_the_built_modules_run_compiled_from_their_current_sources() -> None:
    record = build_record()
    if record is None:  # never built (an install without make): no extension shadows a .py
        assert [name for name in COMPILED_MODULES if extension_path(name).exists()] == []
        assert compiled_now() == [] and core_kind() == "interpreted"
        return
    assert sorted(record) == sorted(COMPILED_MODULES), "the list changed: run make setup"
    assert stale_modules() == [], "edited since the build (the .so shadows it): run make setup"
    assert compiled_now() == list(COMPILED_MODULES) and core_kind() == "compiled"


# dataclasses of the compiled modules whose __init__ is written out (mypyc leaves a
# dataclass-made one interpreted): each must take the fields in order with the same defaults;
# their required fields, given as a compiled class checks them (by type)
REQUEST = Request("r", [1, 2], SamplingParams(), 0.0)
WRITTEN_OUT_INITS: list[tuple[str, str, dict[str, object]]] = [
    ("asyncengine.scheduler.admission", "Admission", {}),
    ("asyncengine.cache.tail_pages", "TailPage", {"page": 3, "prefix": (1,), "tokens": (2,)}),
    ("asyncengine.common.plan", "BatchPlan", {"step": 7}),
    (
        "asyncengine.common.plan",
        "Segment",
        {"rid": "r", "row": 1, "input_ids": [5], "start_pos": 2, "sample": True},
    ),
    ("asyncengine.common.plan", "StepOutput", {"token_ids": [4], "logprobs": [None]}),
    (
        "asyncengine.common.request",
        "Request",
        {"rid": "r", "prompt_ids": [1], "params": SamplingParams(), "arrival_time": 1.5},
    ),
    ("asyncengine.scheduler.step_events", "StepEvents", {}),
    (
        "asyncengine.scheduler.step_events",
        "TokenEvent",
        {"req": REQUEST, "token_id": 9, "logprobs": None, "output_len": 1},
    ),
]


@pytest.mark.parametrize(("module", "name", "required"), WRITTEN_OUT_INITS)
def test_a_written_out_init_takes_the_fields_in_order_with_their_defaults(
    module: str, name: str, required: dict[str, object]
) -> None:
    namespace = importlib.import_module(module)
    cls = getattr(namespace, name)
    fields = dataclasses.fields(cls)
    # read from the source: a compiled __init__ shows no signature
    tree = ast.parse(source_path(module).read_text())
    (body,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    (init,) = [n for n in body.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    names = [a.arg for a in init.args.args[1:]]
    defaults = dict(zip(reversed(names), reversed(init.args.defaults), strict=False))
    assert names == [f.name for f in fields]
    for field in fields:
        given = defaults.get(field.name)
        value = None if given is None else eval(ast.unparse(given), vars(namespace))
        if field.default is not dataclasses.MISSING:
            assert given is not None and value == field.default, field.name
        elif field.default_factory is not dataclasses.MISSING:
            assert given is not None and value is None, field.name  # None: a fresh one each time
        else:
            assert given is None and field.name in required, field.name
    first, second = cls(**required), cls(**required)
    for field in fields:
        if field.default_factory is not dataclasses.MISSING:
            made = getattr(first, field.name)
            assert made == field.default_factory() and made is not getattr(second, field.name)
        elif field.default is not dataclasses.MISSING:
            assert getattr(first, field.name) == field.default
        else:
            assert getattr(first, field.name) == required[field.name]
