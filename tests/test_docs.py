"""The README and the guides in docs/ work as written: every link (and the heading it names) and
repository path they name exists, every `make` target is in the Makefile, and every option their
commands pass to
`asyncengine serve` or to a script is one that command takes (the README's server and policy
examples are run by tests/server/test_server_cli.py and tests/policies/test_policies.py)."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.python_subprocess import run_python

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [
    ROOT / "README.md",
    *(
        ROOT / "docs" / name
        for name in (
            "serving.md",
            "python-api.md",
            "policies.md",
            "scaling-out.md",
            "development.md",
            "agent-apis.md",
            "SECURITY.md",
            "BENCHMARKS.md",
            "ARCHITECTURE.md",
            "EXPERIMENTS.md",
            "KERNELS.md",
            "REPRODUCTIONS.md",
        )
    ),
]
PATH_PREFIXES = ("scripts/", "docs/", "configs/", "asyncengine/", "policies/", "kernels/", "tests/")
PLACEHOLDER = re.compile(r"\*|\b(NAME|DIR|MODEL|POLICY)\b")  # a path the reader fills in
FENCE = re.compile(r"```(\w*)\n(.*?)```", flags=re.S)
INLINE = re.compile(r"`([^`]+)`")
PYTHON = (".venv/bin/python", "python", "python3")
ASYNCENGINE = (".venv/bin/asyncengine", "asyncengine")
PIP = (".venv/bin/pip", "pip", "pip3")
ENV = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
SCRIPT = re.compile(r"scripts/[\w/-]+\.(py|sh)")


@dataclass(frozen=True)
class Command:
    doc: str
    words: tuple[str, ...]


def split_words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: plain words are enough here
        return text.split()


def commands(path: Path) -> list[Command]:
    """Shell commands of a document: its bash blocks' lines (continuations joined) and its
    inline code that runs a script or the CLI; several commands on a line split at `&`, `;`."""
    text = path.read_text()
    lines: list[str] = []
    for lang, block in FENCE.findall(text):
        if lang in ("bash", "sh", ""):
            lines += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    lines += [" ".join(span.split()) for span in INLINE.findall(prose)]
    found = []
    for line in lines:
        for part in re.split(r"\s[&;|]+\s|\s&$|&&", line):
            words = [w.strip("[]") for w in split_words(part)]
            words = [w for w in words if w]
            while words and ENV.fullmatch(words[0]):  # VAR=value before the command
                words = words[1:]
            if words and SCRIPT.fullmatch(words[0]):  # a script run by its path
                words = ["python" if words[0].endswith(".py") else "bash", *words]
            if words and (words[0] in PYTHON + ASYNCENGINE + PIP or words[0] in ("make", "bash")):
                found.append(Command(path.name, tuple(words)))
    return found


def all_commands() -> list[Command]:
    return [c for path in GUIDES for c in commands(path)]


def options(words: tuple[str, ...]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--") and w != "--"]


@functools.cache
def help_text(*command: str) -> str:
    result = subprocess.run(
        [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def serve_options() -> set[str]:
    return set(re.findall(r"--[\w-]+", help_text("-m", "asyncengine.cli", "serve")))


def script_runs() -> dict[str, set[str]]:
    """Script path -> the options the guides pass to it."""
    runs: dict[str, set[str]] = {}
    for command in all_commands():
        words = command.words
        if words[0] in (*PYTHON, "bash") and len(words) > 1 and SCRIPT.fullmatch(words[1]):
            before, _, _ = " ".join(words[2:]).partition(" -- ")
            runs.setdefault(words[1], set()).update(options(tuple(before.split())))
    return runs


def test_the_guides_exist_and_the_readme_is_short() -> None:
    assert all(path.is_file() for path in GUIDES)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()) <= 400


def test_the_serving_guide_gives_each_endpoints_output_length_without_a_limit() -> None:
    """Only chat runs to the end of the context without ``max_tokens``: a user testing that
    on a text completion would get the server's default, so the guide says it."""
    from asyncengine.server.native import NATIVE_DEFAULT_MAX_NEW_TOKENS
    from asyncengine.server.openai_schema import COMPLETIONS_DEFAULT_MAX_TOKENS

    text = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    completions = COMPLETIONS_DEFAULT_MAX_TOKENS
    assert "A chat request without `max_tokens`" in text
    assert f"a text completion without `max_tokens` generates {completions} tokens" in text
    assert f"`/generate` without `max_new_tokens` {NATIVE_DEFAULT_MAX_NEW_TOKENS}" in text


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_links_and_paths_exist(path: Path) -> None:
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http") and not (path.parent / target).exists():
            missing.append(target)
    for span in INLINE.findall(FENCE.sub("", text)):  # a fence's ``` would pair them off
        for word in split_words(span):
            word = word.rstrip(".,:;)")
            if word.startswith(PATH_PREFIXES) and not PLACEHOLDER.search(word):
                if not (ROOT / word).exists():
                    missing.append(word)
    assert missing == []


MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", flags=re.M)


def heading_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """A document's heading ids; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        anchor = heading_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(f"{anchor}-{count}" if count else anchor)
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file, or heading after ``#``, is missing."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part) if file_part else path
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(target)
    return broken


def test_a_link_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# A guide\n\n## Tool calls\n\n## Tool calls\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](guide.md#tool-calls) [twice](guide.md#tool-calls-1) [self](#a-doc)\n"
        "[gone](guide.md#tool-call) [none](missing.md) [own](#nothing)\n# A doc\n"
    )
    assert broken_links(doc) == ["guide.md#tool-call", "missing.md", "#nothing"]
    assert heading_anchor("KV memory and the prefix cache") == "kv-memory-and-the-prefix-cache"
    assert heading_anchor("Scoring prompts: echo, `logprobs`") == "scoring-prompts-echo-logprobs"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(path: Path) -> None:
    assert broken_links(path) == []


def test_security_options_are_the_servers() -> None:
    """Every option SECURITY.md's table names is a flag of `asyncengine serve`, a config key, a
    request field or a policy option."""
    from dataclasses import fields

    from asyncengine.common.config import EngineConfig
    from asyncengine.common.sampling_params import SamplingParams

    rows = (ROOT / "docs" / "SECURITY.md").read_text().splitlines()
    cells = [line.split("|")[-2] for line in rows if line.startswith("| ")]  # the last column
    named = {word.split()[0] for cell in cells for word in INLINE.findall(cell)}
    flags = {word for word in named if word.startswith("--")}
    assert flags and flags <= serve_options(), flags - serve_options()
    keys = {*EngineConfig.__struct_fields__, *(f.name for f in fields(SamplingParams))}
    others = {word for word in named - flags if re.fullmatch(r"[a-z_.]+", word)}
    unknown = {w for w in others if w.split(".")[0] not in keys}
    assert others and not unknown, unknown


def test_make_targets_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = {c.words[1] for c in all_commands() if c.words[0] == "make" and len(c.words) > 1}
    assert named and named - {"ARGS"} <= targets, named - targets


def test_pip_installs_the_checkout() -> None:
    """The project is installed from its checkout: `pip install asyncengine...` would fetch
    whatever a package index holds under that name."""
    installs = [c for c in all_commands() if c.words[0] in PIP and "install" in c.words]
    from_index = [c for c in installs if any(w.startswith("asyncengine") for w in c.words)]
    assert installs and from_index == []


def test_a_test_module_run_standalone_is_run_as_a_module() -> None:
    """A test module imports its helpers from the ``tests`` package, which ``python -m`` puts on
    the path and ``python tests/...py`` does not."""
    by_path = [
        " ".join(c.words)
        for c in all_commands()
        if c.words[0] in PYTHON and len(c.words) > 1 and re.fullmatch(r"tests/.+\.py", c.words[1])
    ]
    assert by_path == []


def test_serve_commands_take_their_options() -> None:
    known = serve_options()
    checked = 0
    for command in all_commands():
        words = command.words
        if words[0] in ASYNCENGINE and words[1:2] == ("serve",):
            unknown = set(options(words)) - known
            assert not unknown, (command.doc, " ".join(words))
            checked += 1
        elif " -- " in " ".join(words):  # a launcher's engine flags after a bare --
            _, _, after = " ".join(words).partition(" -- ")
            unknown = set(options(tuple(after.split()))) - known
            assert not unknown, (command.doc, " ".join(words))
    assert checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(script_runs()))
def test_script_commands_take_their_options(script: str) -> None:
    assert (ROOT / script).is_file(), script
    # a shell script parses its own options: they are written in it
    text = help_text(script) if script.endswith(".py") else (ROOT / script).read_text()
    unknown = sorted(o for o in script_runs()[script] if o not in text)
    assert unknown == [], f"{script} does not take {unknown}"


def guide_examples(path: Path) -> list[tuple[str, str]]:
    """Each ```python block of a guide with the ```text block that shows what it prints."""
    blocks = FENCE.findall(path.read_text())
    return [
        (code, printed)
        for (kind, code), (after, printed) in zip(blocks, blocks[1:], strict=False)
        if kind == "python" and after == "text"
    ]


PYTHON_API_EXAMPLES = guide_examples(ROOT / "docs" / "python-api.md")


@pytest.mark.parametrize("code, printed", PYTHON_API_EXAMPLES)
def test_the_python_api_guides_examples_run_as_written(code: str, printed: str) -> None:
    """Each example runs with the embedded model; its output ends as the guide's (the text
    itself depends on the dtype the CPU picks)."""
    got = run_python(code).strip().splitlines()
    assert got and got[-1].split()[0] == printed.strip().splitlines()[-1].split()[0]


def test_the_python_api_guides_examples_are_all_found() -> None:
    assert len(PYTHON_API_EXAMPLES) == (ROOT / "docs" / "python-api.md").read_text().count(
        "```python"
    )


# files the guides name that live outside this repository
EXTERNAL_FILES = {"convert_hf_to_gguf.py"}  # llama.cpp's converter
SOURCE_NAME = re.compile(r"[\w*./-]+\.(py|c|h)")


@functools.cache
def tree_files() -> tuple[str, ...]:
    folders = {prefix.rstrip("/") for prefix in PATH_PREFIXES}
    return tuple(
        path.relative_to(ROOT).as_posix()
        for folder in sorted(folders)
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
    )


def names_a_file(name: str) -> bool:
    """Whether a file of the tree is ``name`` (a glob's ``*`` stays within one folder): from the
    root when it starts with a top-level folder, else the end of a path (``engine_core.py``,
    ``cpu/cpu_kv.h``)."""
    pattern = re.escape(name).replace(r"\*", "[^/]*")
    if not name.startswith(PATH_PREFIXES):
        pattern = "(.*/)?" + pattern
    return any(re.fullmatch(pattern, path) for path in tree_files())


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_named_source_files_exist(path: Path) -> None:
    """Every Python or C file a guide names in code, by its path, a glob or its bare name, is one
    of the tree's."""
    named = {
        word.rstrip(".,:;)")
        for span in INLINE.findall(FENCE.sub("", path.read_text()))
        for word in split_words(span)
    }
    sources = {n for n in named if SOURCE_NAME.fullmatch(n) and not n.startswith(("/", "~"))}
    missing = sorted(n for n in sources - EXTERNAL_FILES if not names_a_file(n))
    assert missing == []


def test_a_named_file_is_looked_for_where_it_is_said_to_be() -> None:
    assert names_a_file("engine_core.py") and names_a_file("kernels/reference/*_ref.py")
    assert not names_a_file("core.py")
    assert not names_a_file("kernels/*_ref.py")  # the references live in kernels/reference/


def test_every_script_is_in_the_development_guide() -> None:
    """docs/development.md's table of scripts names each script and folder of scripts/."""
    text = (ROOT / "docs" / "development.md").read_text()
    words = {word for span in INLINE.findall(text) for word in split_words(span)}
    # a script by its name or its stem (`bench_lora`), a folder by any path through it
    named = {part for word in words for part in Path(word.removeprefix("scripts/")).parts}
    named |= {Path(word).stem for word in named}
    missing = sorted(
        entry.name
        for entry in (ROOT / "scripts").iterdir()
        if not entry.name.startswith((".", "_"))
        and (entry.suffix in (".py", ".sh") or entry.is_dir())
        and entry.stem not in named
    )
    assert missing == []


def test_every_kernel_file_is_in_the_kernels_guide() -> None:
    text = (ROOT / "docs" / "KERNELS.md").read_text()
    missing = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "kernels").rglob("*")
        if path.suffix in (".py", ".c", ".h")
        and path.name != "__init__.py"
        and f"`{path.name}`" not in text
        and f"`{path.relative_to(ROOT).as_posix()}`" not in text
    )
    assert missing == []
