"""Copy-heavy and random-text prompts for speculative decoding (no downloads): seeded.

Copy-heavy: rewrite or edit a passage or a code file given in the prompt (repeat it, rename an
identifier, fix its comments, convert its docstring): the answer copies long runs of the
prompt, which prompt lookup guesses. The sources are this package's own modules (real Python
code and real prose, in their docstrings). Random text: "continue this" over random words,
where lookup rarely finds a match (the cost of speculating where it does not pay). Random
numbers: "continue this" over random numbers, whose digits' short n-grams recur, so lookup
guesses often and the guesses fail (speculation-hostile text).
"""

from __future__ import annotations

import ast
import random
from importlib import resources

from asyncengine.workloads.trace import WorkloadRequest

Messages = list[dict[str, str]]

_SOURCES = (  # modules of moderate size, stable content
    "core/lifecycle.py",
    "scheduler/scheduler.py",
    "scheduler/retraction.py",
    "scheduler/step_events.py",
    "scheduler/admission.py",
    "common/request.py",
    "api/streams.py",
    "scheduler/prefill.py",
)
_CODE_TASKS = (
    "Repeat the following Python code exactly, without changes:",
    "Rename the variable `req` to `request` everywhere in this code and print the whole code:",
    "Add type hints where they are missing in this code and print the whole code:",
    "Rewrite this code with the same behaviour, keeping every comment:",
)
_PROSE_TASKS = (
    "Rewrite this passage, fixing any spelling mistakes, and keep everything else as it is:",
    "Repeat this text exactly:",
    "Edit this passage so it uses British spelling; print the whole passage:",
)
_WORDS = (
    "river stone window garden paper yellow engine market silver bridge quiet morning table "
    "forest signal orange mirror basket thunder pocket candle winter harbor velvet ladder "
    "copper meadow lantern pillow rocket saddle tunnel violin wagon zebra anchor blossom "
    "cactus dragon feather glacier hammer island jacket kettle lemon magnet needle oyster"
).split()


def _functions(source: str, min_lines: int, max_lines: int) -> list[str]:
    """Top-level and class-level function definitions of ``source`` of a given size."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
            size = node.end_lineno - node.lineno + 1
            if min_lines <= size <= max_lines:
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                found.append("\n".join(line[indent:] for line in body))
    return found


def _docstrings(source: str, min_words: int) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= min_words:
                found.append(doc)
    return found


def copy_heavy_prompts(n: int, seed: int = 0) -> list[Messages]:
    """``n`` chat prompts asking to rewrite or edit code (15-45 lines) or a passage given in
    the prompt, alternating, drawn with ``seed``."""
    rng = random.Random(seed)
    package = resources.files("asyncengine")
    code: list[str] = []
    prose: list[str] = []
    for name in _SOURCES:
        source = package.joinpath(name).read_text()
        code += _functions(source, 15, 45)
        prose += _docstrings(source, 40)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            task, text = rng.choice(_CODE_TASKS), rng.choice(code)
            content = f"{task}\n\n```python\n{text}\n```"
        else:
            task, text = rng.choice(_PROSE_TASKS), rng.choice(prose)
            content = f"{task}\n\n{text}"
        prompts.append([{"role": "user", "content": content}])
    return prompts


def random_text_prompts(n: int, seed: int = 0, words: int = 120) -> list[Messages]:
    """``n`` chat prompts asking to continue ``words`` random words, drawn with ``seed``."""
    rng = random.Random(seed)
    return [
        [
            {
                "role": "user",
                "content": "Continue this text: " + " ".join(rng.choices(_WORDS, k=words)),
            }
        ]
        for _ in range(n)
    ]


def random_number_prompts(n: int, seed: int = 0, numbers: int = 80) -> list[Messages]:
    """``n`` chat prompts asking to continue ``numbers`` random numbers (1 to 6 digits),
    drawn with ``seed``."""
    rng = random.Random(seed)
    return [
        [
            {
                "role": "user",
                "content": "Continue this list of random numbers: "
                + " ".join(str(rng.randrange(10 ** rng.randint(1, 6))) for _ in range(numbers)),
            }
        ]
        for _ in range(n)
    ]


def speculation_trace(
    n: int, copy_share: float, rate: float = 4.0, seed: int = 0
) -> list[WorkloadRequest]:
    """A simulator workload for ranking speculation rules: Poisson arrivals at ``rate``/s,
    random prompts (200-800 tokens) and outputs (64-256), a ``copy_share`` of the requests
    copy-heavy (each guess accepted with a chance drawn in 0.75-0.95, as measured on the
    copy-heavy prompts) and the rest random text (0-0.15)."""
    rng = random.Random(seed)
    requests = []
    now = 0.0
    for i in range(n):
        now += rng.expovariate(rate)
        copy = rng.random() < copy_share
        acceptance = rng.uniform(0.75, 0.95) if copy else rng.uniform(0.0, 0.15)
        prompt = [rng.randrange(10, 49000) for _ in range(rng.randrange(200, 800))]
        requests.append(
            WorkloadRequest(f"r{i}", now, prompt, rng.randrange(64, 256), acceptance=acceptance)
        )
    return requests
