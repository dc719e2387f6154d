"""An agent loop against ``asyncengine serve``: the Anthropic SDK (Messages API) or the OpenAI
SDK (Responses API) lets the model call a local tool until it answers.

    asyncengine serve &                                   # the embedded SmolLM2, port 8000
    .venv/bin/python scripts/agent_loop.py "What is the weather in Paris?"
    .venv/bin/python scripts/agent_loop.py --api responses --stream "And in Oslo?"

Each round sends the conversation and the tool (``get_weather``); every call the model makes
is run here and its result sent back (``tool_use`` -> ``tool_result`` blocks, or
``function_call`` -> ``function_call_output`` items, the Responses rounds chained by
``previous_response_id``), until the model answers in text or ``--max-rounds`` is reached.
``--first-tool-choice`` "required" makes the first round call the tool (a small model may not
think of it). Prints the transcript; exits 1 when the model never answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WEATHER = {"paris": (21, "sunny"), "oslo": (9, "rain"), "lima": (18, "cloudy")}
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "required": ["city"],
}
DESCRIPTION = "The current temperature (Celsius) and sky in a city"


def get_weather(city: str) -> str:
    temperature, sky = WEATHER.get(city.lower(), (None, "unknown city"))
    return json.dumps({"city": city, "temperature": temperature, "sky": sky})


@dataclass(slots=True)
class Transcript:
    """What happened, in order: ("call", "get_weather({...})"), ("result", ...), ("answer", ...)."""

    steps: list[tuple[str, str]] = field(default_factory=list)
    echo: Callable[[str], None] | None = None

    def add(self, kind: str, text: str) -> None:
        self.steps.append((kind, text))
        if self.echo is not None:
            self.echo(f"[{kind}] {text}")

    @property
    def answered(self) -> bool:
        return any(kind == "answer" for kind, _ in self.steps)


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    if name != "get_weather":
        return json.dumps({"error": f"no tool named {name!r}"})
    return get_weather(str(arguments.get("city", "")))


def anthropic_loop(
    base_url: str,
    api_key: str,
    model: str,
    question: str,
    *,
    max_rounds: int = 4,
    first_tool_choice: str = "auto",
    max_tokens: int = 256,
    stream: bool = False,
    transcript: Transcript | None = None,
) -> Transcript:
    import anthropic

    transcript = transcript or Transcript()
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
    tools: Any = [
        {"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER_SCHEMA}
    ]
    messages: list[Any] = [{"role": "user", "content": question}]
    for round_ in range(max_rounds):
        choice = (
            {"required": "any"}.get(first_tool_choice, first_tool_choice) if round_ == 0 else "auto"
        )
        request: dict[str, Any] = dict(
            model=model,
            max_tokens=max_tokens,
            messages=messages,
            tools=tools,
            tool_choice={"type": choice},
        )
        if stream:
            with client.messages.stream(**request) as streamed:
                message = streamed.get_final_message()
        else:
            message = client.messages.create(**request)
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            }
        )
        calls = [block for block in message.content if block.type == "tool_use"]
        text = "".join(block.text for block in message.content if block.type == "text")
        if not calls:
            transcript.add("answer", text)
            return transcript
        results = []
        for call in calls:
            transcript.add("call", f"{call.name}({json.dumps(call.input)})")
            result = run_tool(call.name, dict(call.input))
            transcript.add("result", result)
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": result})
        messages.append({"role": "user", "content": results})
    return transcript


def responses_loop(
    base_url: str,
    api_key: str,
    model: str,
    question: str,
    *,
    max_rounds: int = 4,
    first_tool_choice: str = "auto",
    max_tokens: int = 256,
    stream: bool = False,
    transcript: Transcript | None = None,
) -> Transcript:
    import openai

    transcript = transcript or Transcript()
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
    tools: Any = [
        {
            "type": "function",
            "name": "get_weather",
            "description": DESCRIPTION,
            "parameters": WEATHER_SCHEMA,
        }
    ]
    items: list[Any] = [{"role": "user", "content": question}]
    previous = None
    for round_ in range(max_rounds):
        request: dict[str, Any] = dict(
            model=model,
            input=items,
            tools=tools,
            tool_choice=first_tool_choice if round_ == 0 else "auto",
            max_output_tokens=max_tokens,
        )
        if previous is not None:
            request["previous_response_id"] = previous
        if stream:
            response = None
            for event in client.responses.create(stream=True, **request):
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
            assert response is not None, "the stream ended without its response"
        else:
            response = client.responses.create(**request)
        previous = response.id
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            transcript.add("answer", response.output_text)
            return transcript
        items = []
        for call in calls:
            transcript.add("call", f"{call.name}({call.arguments})")
            try:
                arguments = json.loads(call.arguments)
            except ValueError:
                arguments = {}
            result = run_tool(call.name, arguments if isinstance(arguments, dict) else {})
            transcript.add("result", result)
            items.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": result}
            )
    return transcript


def served_model(base_url: str, api_key: str) -> str:
    import openai

    models = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key).models.list()
    return models.data[0].id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--api-key", default=os.environ.get("ASYNCENGINE_API_KEY", "none"), help="the server's"
    )
    parser.add_argument("--api", choices=("anthropic", "responses"), default="anthropic")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--max-rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--first-tool-choice", choices=("auto", "required"), default="auto")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    model = args.model or served_model(args.base_url, args.api_key)
    loop = anthropic_loop if args.api == "anthropic" else responses_loop
    transcript = loop(
        args.base_url,
        args.api_key,
        model,
        args.question,
        max_rounds=args.max_rounds,
        first_tool_choice=args.first_tool_choice,
        max_tokens=args.max_tokens,
        stream=args.stream,
        transcript=Transcript(echo=print),
    )
    if not transcript.answered:
        print(f"no answer after {args.max_rounds} rounds", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
