"""docs/REPRODUCTIONS.md and its JSON: each reproduction owns one section and one file.

A section lies between ``<!-- reproduction: NAME -->`` and ``<!-- /reproduction: NAME -->``;
running a reproduction replaces its own section (or appends it) and leaves the rest of the page
as it was. The JSON (``docs/reproductions/NAME.json``) keeps the last simulated and the last
real outcome, so a simulated run does not drop the real numbers of an earlier ``--real`` run.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncengine.sim.reproductions.base import Outcome, Reproduction

MODES = {"sim": "In the simulator", "real": "On the real engine (CPU)"}
PAGE_HEADER = """# Published scheduling results, reproduced

Each section below is written by `python scripts/reproduce.py NAME` (`--real`: also on the
real engine on the CPU) and by nothing else: the claim with its source, our setting, and our
numbers beside the claim's. `python scripts/reproduce.py --list` lists the reproductions; the
numbers of each section are also in `docs/reproductions/NAME.json`. Simulated runs use the
shipped cost model (`asyncengine/sim/default_cost_model.json`) on a virtual clock, so their
verdicts hold on any machine; real runs time each step on the CPU clock of the machine that ran
them (SmolLM2-135M, one torch thread).
"""


def _commit() -> str:
    """The checkout's commit, marked ``+changes`` when the tree differs from it: kept in the
    JSON to tell which code made a run (the page leaves it to git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "asyncengine",
             "policies", "kernels"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if changes else head


def record(reproduction: Reproduction, mode: str, outcome: Outcome, json_dir: Path) -> Path:
    """Store ``outcome`` as ``mode`` in the reproduction's JSON (other modes kept)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    json_dir.mkdir(parents=True, exist_ok=True)
    path = json_dir / f"{reproduction.name}.json"
    data: dict[str, Any] = {}
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
    data.update(name=reproduction.name, title=reproduction.title, claim=asdict(reproduction.claim))
    data.setdefault("runs", {})[mode] = {**asdict(outcome), "commit": _commit()}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def section(data: dict[str, Any]) -> str:
    """The markdown of one reproduction from its stored JSON."""
    claim = data["claim"]
    lines = [
        f"## {data['title']}",
        "",
        f"**Claim.** {claim['text']} ({claim['source']}, <{claim['url']}>)",
        "",
    ]
    for mode, heading in MODES.items():
        run = data.get("runs", {}).get(mode)
        if run is None:
            continue
        verdict = "holds" if run["holds"] else "does not hold"
        lines += [
            f"### {heading}: the claim {verdict}",
            "",
            f"**Setting.** {run['setting']}",
            "",
            run["table"].rstrip("\n"),
            "",
            run["verdict"],
            "",
        ]
    lines.append(
        f"Reproduce: `python scripts/reproduce.py {data['name']}` (add `--real` for the CPU run)."
    )
    return "\n".join(lines) + "\n"


def update_page(page: Path, name: str, text: str) -> None:
    """Put ``text`` as the section of ``name`` in ``page`` (created with its header if new)."""
    start, end = f"<!-- reproduction: {name} -->", f"<!-- /reproduction: {name} -->"
    block = f"{start}\n{text}{end}\n"
    content = page.read_text(encoding="utf-8") if page.exists() else PAGE_HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    if pattern.search(content):
        content = pattern.sub(lambda _: block, content, count=1)
    else:
        content = content.rstrip("\n") + "\n\n" + block
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(content, encoding="utf-8")


def write(
    reproduction: Reproduction, mode: str, outcome: Outcome, page: Path, json_dir: Path
) -> Path:
    """Record the outcome and rewrite the reproduction's section of ``page``; the JSON path."""
    path = record(reproduction, mode, outcome, json_dir)
    update_page(page, reproduction.name, section(json.loads(path.read_text(encoding="utf-8"))))
    return path
