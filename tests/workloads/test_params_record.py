"""A live trace records a request's sampling parameters that differ from the defaults; a
tool-call grammar's spec once, not again in the parts it names on a compile error."""

from __future__ import annotations

import json

from asyncengine.common.sampling_params import SamplingParams, StructuredOutput
from asyncengine.workloads.trace_recorder import params_record


def test_a_constraints_parts_are_not_recorded_again() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parts = tuple(
        StructuredOutput.json_schema(schema, f"tools[{i}].function.parameters") for i in range(2)
    )
    spec = json.dumps({"type": "structural_tag", "format": {"schemas": [schema, schema]}})
    structured = StructuredOutput("structural_tag", spec, "tools", parts)
    record = params_record(SamplingParams(max_new_tokens=8, temperature=0.5, structured=structured))
    assert record == {
        "temperature": 0.5,
        "structured": {"kind": "structural_tag", "spec": spec, "param": "tools", "parts": ()},
        "max_new_tokens": 8,
    }
    assert structured.parts == parts  # the request's own constraint keeps them
