"""The compiled core (mypyc; make setup runs scripts/build_native.py) is the one in use when it
was built from the sources as they are; once one of them is edited, every compiled module runs
from its ``.py`` (one warning names the edited ones) until ``make setup`` builds again, so a
stale ``.so`` never runs in place of an edit and never stops the tests."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.common.request import Request
from asyncengine.common.sampling_params import SamplingParams
from asyncengine.compiled import (
    COMPILED_MODULES,
    build_record,
    compiled_now,
    core_kind,
    edited_since_build,
    extension_path,
    source_hash,
    source_path,
    stale_modules,
)


def test_the_core_runs_compiled_only_when_built_from_the_current_sources() -> None:
    record = build_record()
    if record is None:  # never built (an install without make): no extension shadows a .py
        assert [name for name in COMPILED_MODULES if extension_path(name).exists()] == []
        assert compiled_now() == [] and core_kind() == "interpreted"
        return
    edited = stale_modules()
    if edited:  # edited since the build: all of them from their .py, the edited ones named
        assert edited_since_build() == edited
        assert compiled_now() == [] and core_kind() == "interpreted"
    else:
        assert edited_since_build() == []
        assert compiled_now() == list(COMPILED_MODULES) and core_kind() == "compiled"


# A fresh interpreter whose build record is the file given: it imports the compiled modules
# and prints where each came from, the core's kind and the warnings the import gave.
IMPORT_WITH_RECORD = """
import importlib, importlib.util, json, sys, warnings
from pathlib import Path

spec = importlib.util.spec_from_file_location("asyncengine.compiled", sys.argv[1])
compiled = importlib.util.module_from_spec(spec)
sys.modules["asyncengine.compiled"] = compiled
spec.loader.exec_module(compiled)
compiled.BUILD_RECORD = Path(sys.argv[2])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    files = {name: importlib.import_module(name).__file__ for name in compiled.COMPILED_MODULES}
print(json.dumps({
    "files": files,
    "kind": compiled.core_kind(),
    "edited": compiled.edited_since_build(),
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
}))
"""


def import_with_record(record: dict[str, str | None], directory: Path) -> dict[str, object]:
    path = directory / "compiled.json"
    path.write_text(json.dumps({"sources": record}))
    compiled_py = str(source_path("asyncengine.compiled"))
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_WITH_RECORD, compiled_py, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_an_edit_since_the_build_runs_every_compiled_module_from_its_source(
    tmp_path: Path,
) -> None:
    current = {name: source_hash(name) for name in COMPILED_MODULES}
    # the build record of the sources as they are: whatever is built loads as built
    fresh = import_with_record(current, tmp_path)
    assert fresh["warnings"] == [] and fresh["edited"] == []
    built = [name for name in COMPILED_MODULES if extension_path(name).exists()]
    files = fresh["files"]
    assert isinstance(files, dict)
    assert [name for name in COMPILED_MODULES if not files[name].endswith(".py")] == built
    # scheduler.py edited since the build: all of them from their .py (the others call it
    # directly when compiled), one warning naming it
    edited = import_with_record({**current, "asyncengine.scheduler.scheduler": "0" * 64}, tmp_path)
    assert edited["edited"] == ["asyncengine.scheduler.scheduler"]
    assert edited["files"] == {name: str(source_path(name)) for name in COMPILED_MODULES}
    assert edited["kind"] == "interpreted"
    (warning,) = edited["warnings"]  # type: ignore[misc]
    assert warning.startswith("StaleBuildWarning: edited since the compiled build: ")
    assert "asyncengine.scheduler.scheduler;" in warning and "make setup" in warning
    # a module the build never compiled (the list changed) counts as edited too
    listed_since = {name: h for name, h in current.items() if name != "asyncengine.common.plan"}
    assert import_with_record(listed_since, tmp_path)["edited"] == ["asyncengine.common.plan"]


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
