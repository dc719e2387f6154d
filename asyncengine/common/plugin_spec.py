"""How a plug-in (a policy, an eviction rule, a length predictor) is named: a built-in name,
"package.module:Class" (an importable module) or "path/to/file.py:Class" (a file anywhere).
A config file's relative file paths are relative to the file itself, as a user who keeps a
policy beside its config expects; a command line's stay relative to where it runs. So are the
local model and LoRA adapter paths a config file names (``model_path``)."""

from __future__ import annotations

import os
from pathlib import Path

# the config keys that name plug-ins (and, for policies, compositions of them with '+')
PLUGIN_KEYS = ("eviction_policy", "allowed_eviction_policies", "length_predictor")
POLICY_KEYS = ("policy", "shadow_policy", "allowed_policies")


def file_part(spec: str) -> str | None:
    """The file path of a "path/to/file.py:Class" spec (None: a built-in or module name)."""
    if ":" not in spec:
        return None
    module = spec.rpartition(":")[0].strip()
    return module if module.endswith(".py") or "/" in module else None


def same_plugin(first: str, second: str) -> bool:
    """Whether two specs name the same plug-in: the same name, or the same file (however its
    path is written) and class."""
    if first.strip() == second.strip():
        return True
    paths = file_part(first), file_part(second)
    if paths[0] is None or paths[1] is None:
        return False
    same_file = Path(paths[0]).expanduser().resolve() == Path(paths[1]).expanduser().resolve()
    return same_file and first.rpartition(":")[2].strip() == second.rpartition(":")[2].strip()


def anchored(spec: str, folder: Path, composed: bool = False) -> str:
    """``spec`` with a relative file path taken as relative to ``folder``; ``composed``: each
    '+' part of a policy composition on its own."""
    if composed and "+" in spec:
        return "+".join(anchored(part, folder) for part in spec.split("+"))
    path = file_part(spec)
    if path is None or Path(path).expanduser().is_absolute():
        return spec
    return f"{folder / path}:{spec.rpartition(':')[2]}"


def model_path(value: str, folder: Path) -> str:
    """``value``, a model (or adapter) the loader takes as a path or a known name, as a path in
    ``folder`` when it is relative and says it is a path ("./m", "../m") or names something
    there; otherwise as it is (an absolute path, a known name such as "smollm2-135m", or a
    path from the working directory, as the loader reads it)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return value
    if value.startswith(("./", "../")) or (folder / path).exists():
        return os.path.normpath(folder / path)  # ``folder`` is resolved: ".." is its parent
    return value


def anchor_config_paths(values: dict[str, object], folder: Path) -> dict[str, object]:
    """A config file's ``values`` with the plug-in files, model and LoRA adapters it names by
    relative paths taken as relative to ``folder`` (the file's own folder); other values as
    they are."""
    out = dict(values)
    model, loras, speculative = out.get("model"), out.get("loras"), out.get("speculative")
    if isinstance(model, str):
        out["model"] = model_path(model, folder)
    if isinstance(loras, dict):
        out["loras"] = {
            name: model_path(path, folder) if isinstance(path, str) else path
            for name, path in loras.items()
        }
    if isinstance(speculative, dict) and isinstance(speculative.get("model"), str):
        out["speculative"] = {**speculative, "model": model_path(speculative["model"], folder)}
    for key in PLUGIN_KEYS + POLICY_KEYS:
        value = out.get(key)
        composed = key in POLICY_KEYS
        if isinstance(value, str):
            out[key] = anchored(value, folder, composed)
        elif isinstance(value, list):
            out[key] = [
                anchored(item, folder, composed) if isinstance(item, str) else item
                for item in value
            ]
    return out
