"""Tool calls and reasoning without a model: the parsers (whole and streamed in any split), the
chat formats read from templates, the rendered conversation, and the call grammars."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from asyncengine.server.chat_output import ChoiceReader, read_choice
from asyncengine.server.chat_tools import ChatOutputSpec
from asyncengine.text.chat_format import (
    FALLBACK_TOOL_PROMPT,
    ChatTurn,
    chat_format,
    template_messages,
)
from asyncengine.text.reasoning import ReasoningParser, prompt_opens_thinking, split_reasoning
from asyncengine.text.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    arguments_so_far,
    collect_calls,
    parse_tool_calls,
    tool_parser,
)
from tests.chat_models import TEMPLATES

HERMES_OUTPUT = (
    "Let me look. <tool_call>\n"
    '{"name": "get_weather", "arguments": '
    '{"city": "Paris", "when": {"days": [1, 2]}, "q": "a}b</tool_call>"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call> done <tool_call>{not json}</tool_call>'
)


def _splits(text: str, rng: random.Random, pieces: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_hermes_calls_are_parsed_and_a_bad_block_stays_text() -> None:
    text, calls = parse_tool_calls(HERMES, HERMES_OUTPUT)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # the end marker inside a string is the string's text
    args = {"city": "Paris", "when": {"days": [1, 2]}, "q": "a}b</tool_call>"}
    assert json.loads(calls[0].arguments) == args
    assert calls[1].arguments == "{}"
    assert text == "Let me look. \n done <tool_call>{not json}</tool_call>"
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("seed", range(40))
def test_streamed_calls_equal_the_whole_parse_however_the_text_is_cut(seed: int) -> None:
    rng = random.Random(seed)
    parser = tool_parser(HERMES)
    text, deltas = "", []
    for piece in _splits(HERMES_OUTPUT, rng, rng.randint(1, 40)):
        out = parser.feed(piece)
        text += out.text
        deltas += out.calls
    out = parser.finish()
    text += out.text
    deltas += out.calls
    whole_text, whole = parse_tool_calls(HERMES, HERMES_OUTPUT)
    assert text == whole_text
    streamed = collect_calls(deltas)
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole]
    # OpenAI's order: each call's first piece has its id and name, the later ones only arguments
    for index in range(2):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id is not None and mine[0].name is not None
        assert all(d.id is None and d.name is None for d in mine[1:])


def test_a_call_cut_by_the_length_limit_keeps_what_was_streamed() -> None:
    text, calls = parse_tool_calls(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b')
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1, "b')]
    parser = tool_parser(HERMES)
    assert parser.feed("Look: <tool_call>\n{").text == "Look: "
    assert (parser.finish().text, parser.cut) == ("", True)  # no name yet: neither text nor call
    closed = tool_parser(HERMES)
    pieces = closed.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}').calls
    pieces += closed.finish().calls  # the arguments closed, the call's markup did not
    assert ([c.arguments for c in collect_calls(pieces)], closed.cut) == (['{"a": 1}'], False)


def test_a_llama3_output_cut_keeps_its_whole_calls_and_the_cut_ones_arguments() -> None:
    output = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [2'
    parser = tool_parser(LLAMA3_JSON)
    parser.feed(output)
    out = parser.finish()
    assert out.text == "" and parser.cut
    assert [(c.name, c.arguments) for c in collect_calls(out.calls)] == [
        ("f", '{"x": 1}'),
        ("g", '{"y": [2'),
    ]
    assert parse_tool_calls(LLAMA3_JSON, '{"name": "f') == ("", [])  # its name is not whole


def test_a_call_cut_right_after_its_name_is_a_cut_call_with_no_arguments() -> None:
    """Not dropped: the name was written whole, so the call is reported with the arguments
    written so far (none), as cut (never a finished call)."""
    for fmt, output in (
        (HERMES, '<tool_call>\n{"name": "f", "'),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": '),
        (LLAMA3_JSON, '{"name": "f", "param'),
        (LLAMA3_JSON, '{"name": "g", "parameters": {}}; {"name": "f"'),
    ):
        parser = tool_parser(fmt)
        pieces = parser.feed(output).calls + parser.finish().calls
        assert [(c.name, c.arguments) for c in collect_calls(pieces)][-1] == ("f", ""), output
        assert parser.cut, output
    spec = ChatOutputSpec(HERMES, reasoning_starts_inside=None, calls_only=True)
    output = '<tool_call>\n{"name": "f", "'
    message, reason = read_choice(spec, output, "stop")
    assert reason == "stop" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", "")
    ]
    reader = ChoiceReader(spec)
    deltas = [reader.feed(ch) for ch in output[:-1]] + [reader.feed(output[-1], final=True)]
    streamed = [call for d in deltas if d for call in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in streamed] == ["f"]
    # a name cut short is no name: the call is left out
    assert read_choice(spec, '<tool_call>\n{"name": "f', "length")[0]["content"] == ""


def test_the_arguments_so_far_are_the_members_written_whole() -> None:
    """What Anthropic's client reads from a cut stream of partial_json (jiter's partial mode)."""
    cases = {
        '{"a": 12': {"a": 12},
        '{"a": [1, "x': {"a": [1]},
        '{"a": {"b": 1, "c": "x': {"a": {"b": 1}},
        '{"a": {"b": 1, "c"': {"a": {"b": 1}},
        '{"a": nu': {},
        '{"a": 1.5e': {},
        '{"a": {}, "b": [': {"a": {}, "b": []},
        '{"a": "q\\': {},
        "": {},
        '{"a": {"b": [1, {"c": true}], "d": null}, "e": "f"}': {
            "a": {"b": [1, {"c": True}], "d": None},
            "e": "f",
        },
    }
    for text, members in cases.items():
        assert arguments_so_far(text) == members, text


def test_llama3_json_calls_and_plain_text() -> None:
    text, calls = parse_tool_calls(
        LLAMA3_JSON,
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
    )
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_tool_calls(LLAMA3_JSON, "The answer is 4.") == ("The answer is 4.", [])
    assert parse_tool_calls(LLAMA3_JSON, '{"x": 1}')[1] == []  # JSON but no call


@pytest.mark.parametrize("seed", range(20))
def test_reasoning_split_is_the_same_however_the_text_is_cut(seed: int) -> None:
    rng = random.Random(seed)
    output = "<think>\nFirst, 2+2.\n</think>\n\nIt is 4. <think> stays"
    parser = ReasoningParser(starts_inside=False)
    reasoning = content = ""
    for piece in _splits(output, rng, rng.randint(1, 20)):
        out = parser.feed(piece)
        reasoning += out.reasoning
        content += out.content
    out = parser.finish()
    assert (reasoning + out.reasoning, content + out.content) == (
        "\nFirst, 2+2.\n",
        "It is 4. <think> stays",
    )


def test_reasoning_starting_inside_and_unclosed() -> None:
    assert split_reasoning("hm</think>ok", starts_inside=True).content == "ok"
    unclosed = split_reasoning("<think>still going", starts_inside=False)
    assert (unclosed.reasoning, unclosed.content) == ("still going", "")
    plain = split_reasoning("no thinking here", starts_inside=False)
    assert (plain.reasoning, plain.content) == ("", "no thinking here")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("assistant\n<think>\n\n</think>\n\n")


def test_reading_a_choice_whole_and_streamed_agree() -> None:
    spec = ChatOutputSpec(HERMES, reasoning_starts_inside=False)
    output = (
        '<think>plan</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    message, reason = read_choice(spec, output, "stop")
    assert reason == "tool_calls"
    assert message["reasoning_content"] == "plan" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": '{"a": 1}'}
    ]
    reader = ChoiceReader(spec)
    deltas = [reader.feed(ch) for ch in output[:-1]] + [reader.feed(output[-1], final=True)]
    sent = [d for d in deltas if d]
    assert "".join(d.get("reasoning_content", "") for d in sent) == "plan"
    assert not any(d.get("content") for d in sent)  # the blank between </think> and the call
    arguments = "".join(c["function"]["arguments"] for d in sent for c in d.get("tool_calls", []))
    assert arguments == '{"a": 1}'
    assert read_choice(spec, "just text", "length") == (
        {"role": "assistant", "content": "just text", "reasoning_content": None},
        "length",
    )


def test_a_call_cut_off_under_a_calls_only_choice_leaves_no_markup_as_content() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    output = call + '\n<tool_call>\n{"na'  # the length limit met inside a second call
    spec = ChatOutputSpec(HERMES, reasoning_starts_inside=None, calls_only=True)
    message, reason = read_choice(spec, output, "length")
    assert (message["content"], reason) == (None, "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    reader = ChoiceReader(spec)
    deltas = [reader.feed(ch) for ch in output[:-1]] + [reader.feed(output[-1], final=True)]
    assert not any(d.get("content") for d in deltas if d)
    # where text may stand beside calls ("auto"), the cut call's markup is no text either
    auto = ChatOutputSpec(HERMES, reasoning_starts_inside=None)
    message, reason = read_choice(auto, "Sure. " + output, "length")
    assert (message["content"], reason) == ("Sure. \n", "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]


def test_a_call_cut_by_a_stop_string_is_no_finished_call() -> None:
    auto = ChatOutputSpec(HERMES, reasoning_starts_inside=None)
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "x'
    message, reason = read_choice(auto, cut, "stop")
    assert reason == "stop" and message["tool_calls"][0]["function"]["arguments"] == '{"a": "x'
    whole = cut + '"}}\n</tool_call>'
    assert read_choice(auto, whole, "stop")[1] == "tool_calls"


@pytest.mark.parametrize(
    ("output", "calls_only"),
    [
        ("just text", False),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', True),
        ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n', False),
        ('\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', False),
        ("\n\n", False),
        ('<tool_call>\n{"na', True),
    ],
)
def test_the_streamed_deltas_accumulate_to_the_whole_message(output: str, calls_only: bool) -> None:
    """As the openai client accumulates them: content null in the role chunk, then each
    delta's content joined (a null leaves it as it was)."""
    spec = ChatOutputSpec(HERMES, reasoning_starts_inside=None, calls_only=calls_only)
    message, _ = read_choice(spec, output, "stop")
    reader = ChoiceReader(spec)
    deltas = [reader.feed(ch) for ch in output[:-1]] + [reader.feed(output[-1], final=True)]
    content: str | None = None
    for delta in filter(None, deltas):
        if delta.get("tool_calls"):
            assert "content" in delta and delta["content"] is None
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
    assert content == message["content"]


LLAMA31_LIKE = (
    "{% if tools %}Given the following functions, respond with a JSON for a function call "
    'with its proper arguments: {"name": function name, "parameters": dictionary}.'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'ipython' %}<|python_tag|>{% endif %}"
    "{{ m.content }}{% endfor %}"
)


def test_chat_formats_read_from_templates(tiny_tokenizer_template: str) -> None:
    qwen3 = chat_format((TEMPLATES / "qwen3_style.jinja").read_text())
    assert (qwen3.renders_tools, qwen3.tool_format, qwen3.reasons) == (True, HERMES, True)
    llama = chat_format(LLAMA31_LIKE)
    assert (llama.renders_tools, llama.tool_format, llama.reasons) == (True, LLAMA3_JSON, False)
    smol = chat_format(tiny_tokenizer_template)  # no tools in the embedded model's template
    assert (smol.renders_tools, smol.tool_format, smol.reasons) == (False, HERMES, False)
    assert chat_format(None).renders_tools is False


@pytest.fixture(scope="module")
def tiny_tokenizer_template() -> str:
    import torch

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model
    from asyncengine.text.tokenizer import Tokenizer

    template = Tokenizer(resolve_model(DEFAULT_MODEL, torch.bfloat16)).chat_template
    assert template is not None
    return template


def test_the_fallback_prompt_carries_tools_calls_and_results() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turns = [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "go"),
        ChatTurn("assistant", "", [("call_1", "f", '{"a": 1}')]),
        ChatTurn("tool", "42", tool_call_id="call_1"),
    ]
    fmt = chat_format(None)
    messages, template_tools = template_messages(turns, fmt, tools)
    assert template_tools is None
    assert messages[0]["role"] == "system"
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(tools[0]) in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert "<tool_call>" in FALLBACK_TOOL_PROMPT


def test_a_parallel_calls_results_share_one_user_turn_in_an_alternating_template(
    tmp_path: Path,
) -> None:
    import torch

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model
    from asyncengine.text.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model(DEFAULT_MODEL, torch.bfloat16) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TEMPLATES / "gemma3_style.jinja", tmp_path / "chat_template.jinja")
    tokenizer = Tokenizer(tmp_path)
    fmt = chat_format(tokenizer.chat_template)
    assert not fmt.renders_tools
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turns = [
        ChatTurn("user", "go"),
        ChatTurn("assistant", "", [("call_1", "f", '{"a": 1}'), ("call_2", "f", '{"a": 2}')]),
        ChatTurn("tool", "41", tool_call_id="call_1"),
        ChatTurn("tool", "42", tool_call_id="call_2"),
    ]
    messages, _ = template_messages(turns, fmt, tools)
    prompt = tokenizer.apply_chat_template(messages)  # raised: roles must alternate
    assert prompt.endswith(
        "<start_of_turn>user\n<tool_response>\n41\n</tool_response>\n"
        "<tool_response>\n42\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_template_that_renders_tools_gets_them_and_hf_shaped_calls() -> None:
    fmt = chat_format((TEMPLATES / "qwen3_style.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "f"}}]
    turns = [
        ChatTurn("assistant", "", [("call_1", "f", '{"a": 1}')]),
        ChatTurn("tool", "42", None, "call_1"),
    ]
    messages, template_tools = template_messages(turns, fmt, tools)
    assert template_tools == tools
    assert messages[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert messages[1] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


def _matcher(grammar_spec: str):  # an xgrammar matcher on the default model's vocabulary
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    from asyncengine.executor.loader import DEFAULT_MODEL, resolve_model
    from asyncengine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(DEFAULT_MODEL, torch.bfloat16))
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=tokenizer.eos_token_ids,
    )
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_structural_tag(grammar_spec)
    return lambda: xgrammar.GrammarMatcher(compiled)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
}


def test_call_grammars_accept_valid_calls_only() -> None:
    from asyncengine.structured.tool_grammar import ToolFunction, tool_call_grammar

    functions = [ToolFunction("get_weather", WEATHER), ToolFunction("ping", True)]
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    bad_value = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    required = _matcher(tool_call_grammar(HERMES, functions, "required").spec)
    auto = _matcher(tool_call_grammar(HERMES, functions, "auto").spec)
    named = _matcher(tool_call_grammar(HERMES, functions[1:], "named").spec)
    reasoning = _matcher(tool_call_grammar(HERMES, functions, "required", reasoning=True).spec)

    def accepts(make, text: str) -> bool:
        matcher = make()
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    assert accepts(required, good) and accepts(required, good + "\n" + good)
    # a newline after the last call may end the output: it does not oblige another call
    assert accepts(required, good + "\n") and accepts(required, good + "\n" + good + "\n")
    assert not accepts(required, good + "\n\n")
    assert not accepts(required, "Sure! " + good)  # nothing but calls
    assert not accepts(required, bad_value) and not accepts(required, unknown)
    assert not accepts(required, "")
    assert accepts(auto, "plain text") and accepts(auto, "text " + good)
    assert not accepts(auto, "text " + bad_value)  # once begun, a call must be valid
    assert accepts(named, '<tool_call>\n{"name": "ping", "arguments": {"x": [1]}}\n</tool_call>')
    assert not accepts(named, good)
    assert accepts(reasoning, "<think>hmm</think>\n\n" + good) and accepts(reasoning, good)
    # auto with a response format: its JSON answer or calls, nothing else
    for thinks in (False, True):
        answer = _matcher(
            tool_call_grammar(HERMES, functions, "auto", reasoning=thinks, answer=WEATHER).spec
        )
        assert accepts(answer, '{"city": "Oslo"}') and accepts(answer, good + "\n" + good)
        assert not accepts(answer, '{"city": "Rome"}') and not accepts(answer, "plain text")
        assert not accepts(answer, "text " + good)
        assert accepts(answer, "<think>hmm</think>\n\n" + '{"city": "Oslo"}') == thinks


def test_the_llama3_grammar_writes_parameters_json_calls() -> None:
    from asyncengine.structured.tool_grammar import ToolFunction, tool_call_grammar

    functions = [ToolFunction("get_weather", WEATHER), ToolFunction("ping", True)]
    required = _matcher(tool_call_grammar(LLAMA3_JSON, functions, "required").spec)
    auto = _matcher(tool_call_grammar(LLAMA3_JSON, functions, "auto").spec)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

    def accepts(make, text: str) -> bool:
        matcher = make()
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    assert accepts(required, call) and accepts(
        required, call + '; {"name": "ping", "parameters": {}}'
    )
    assert not accepts(required, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert accepts(auto, "It is sunny.") and accepts(auto, call)
    text, calls = parse_tool_calls(LLAMA3_JSON, call)
    assert text == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_descriptions_bound_nothing_so_the_grammar_leaves_them_out() -> None:
    """An agent's tool set is mostly descriptions: they neither count toward the grammar's
    size limit nor change what it accepts; a property named "description" stays."""
    from asyncengine.structured.schema_annotations import grammar_schema
    from asyncengine.structured.tool_grammar import ToolFunction, tool_call_grammar

    described = {
        "type": "object",
        "title": "Args",
        "description": "x" * 3000,
        "properties": {
            "description": {"type": "string", "description": "y" * 3000, "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string", "examples": ["a"]}},
            "mode": {"anyOf": [{"const": "a", "title": "A"}, {"const": "b"}], "default": "a"},
        },
        "required": ["description"],
    }
    assert grammar_schema(described) == {
        "type": "object",
        "properties": {
            "description": {"type": "string", "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"anyOf": [{"const": "a"}, {"const": "b"}]},
        },
        "required": ["description"],
    }
    assert described["properties"]["description"]["description"] == "y" * 3000  # untouched
    functions = [ToolFunction(f"tool_{i}", described) for i in range(20)]  # 120k of descriptions
    grammar = tool_call_grammar(HERMES, functions, "required")  # under the limit: no refusal
    assert "xxx" not in grammar.spec and len(grammar.spec) < 20_000
    matcher = _matcher(grammar.spec)()
    call = '<tool_call>\n{"name": "tool_3", "arguments": {"description": "hi", "mode": "b"}}'
    assert matcher.accept_string(call + "\n</tool_call>") and matcher.is_completed()
    too_long = _matcher(grammar.spec)()
    assert not too_long.accept_string(call.replace('"hi"', '"toolong"') + "\n</tool_call>")


def test_openapi_nullable_lets_a_tool_argument_be_null() -> None:
    """OpenAPI 3.0's ``nullable: true`` (what clients generated from OpenAPI specs send) adds
    null to the field's ``type``; without a ``type`` beside it, it does nothing (OpenAPI 3.0.3)."""
    from asyncengine.structured.schema_annotations import grammar_schema
    from asyncengine.structured.tool_grammar import ToolFunction, tool_call_grammar

    schema = {
        "type": "object",
        "properties": {
            "note": {"type": "string", "nullable": True},
            "days": {"type": "array", "items": {"type": ["integer"], "nullable": True}},
            "kind": {"enum": ["a", "b"], "nullable": True},
            "city": {"type": "string", "nullable": False},
        },
        "required": ["note", "days", "city"],
    }
    assert grammar_schema(schema)["properties"] == {
        "note": {"type": ["string", "null"]},
        "days": {"type": "array", "items": {"type": ["integer", "null"]}},
        "kind": {"enum": ["a", "b"]},
        "city": {"type": "string"},
    }
    grammar = tool_call_grammar(HERMES, [ToolFunction("f", schema)], "named").spec

    def accepts(arguments: str) -> bool:
        matcher = _matcher(grammar)()
        call = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        return bool(matcher.accept_string(call)) and matcher.is_completed()

    assert accepts('{"note": null, "days": [1, null], "city": "Oslo"}')
    assert accepts('{"note": "hi", "days": [], "city": "Oslo"}')
    assert not accepts('{"note": "hi", "days": [], "city": null}')


def test_call_arguments_follow_the_schemas_own_property_order() -> None:
    """A model writes a call's arguments in the order its tool lists them (the order it was
    trained on and the prompt shows), not sorted by name."""
    from asyncengine.structured.tool_grammar import ToolFunction, tool_call_grammar

    schema = {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "amount": {"type": "integer"}},
        "required": ["zone", "amount"],
    }
    make = _matcher(tool_call_grammar(HERMES, [ToolFunction("pay", schema)], "required").spec)

    def accepts(arguments: str) -> bool:
        matcher = make()
        text = f'<tool_call>\n{{"name": "pay", "arguments": {arguments}}}\n</tool_call>'
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    assert accepts('{"zone": "eu", "amount": 3}')


@pytest.mark.parametrize(
    "answer",
    [
        '{"name": "Alice", "age": 30}',  # a response format's object whose first key is "name"
        '{"name": "Alice"}',
        '{"name": "f", "parameters": {}, "note": 1}',
        '{"name": "Alice", "age": 3',  # cut by the length limit
    ],
)
def test_a_llama3_json_answer_with_a_name_key_is_text_not_a_call(answer: str) -> None:
    assert parse_tool_calls(LLAMA3_JSON, answer) == (answer, [])


def test_a_llama3_call_may_lead_with_its_type() -> None:
    text, calls = parse_tool_calls(
        LLAMA3_JSON, '{"type": "function", "name": "f", "parameters": {"x": 1}}'
    )
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
