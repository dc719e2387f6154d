"""SpeculativeConfig: the ``speculative`` table of the engine config, checked once.

    speculative = {"method": "ngram", "num_speculative_tokens": 4,
                   "prompt_lookup_min": 2, "prompt_lookup_max": 4, "rule": "adaptive"}
    speculative = {"method": "draft", "model": "/path/to/small-model", "num_speculative_tokens": 4}

"ngram" copies guesses from the request's own tokens (ngram.py, on the scheduler side);
"draft" has a smaller model of the same tokenizer guess them, run by the executor over KV pages
of its own (speculative/draft/draft_proposer.py). ``model`` is for "draft" only and the
``prompt_lookup_*`` keys for "ngram" only: a key the method would ignore is an error.

``rule`` says how many guesses a request gets each step (``Policy.speculate``): "fixed" always
``num_speculative_tokens`` (when the proposer finds that many), "adaptive" fewer as the
request's acceptance rate falls and none once the step's batch is compute bound (rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft")
_NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")
RULES = ("adaptive", "fixed")
_DEFAULTS: dict[str, Any] = {
    "method": "ngram",
    "model": None,  # the draft model (method "draft"): a path or a known model name
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "rule": "adaptive",
    # adaptive rule: no speculation once a step verifies this many tokens (compute bound). On
    # a CPU a step turns compute bound where the quantized kernels hand over to the dense
    # product (executor/layers/linear.py DENSE_FROM_ROWS, 64): with 256, speculation-hostile text cost
    # 13% at batch 64 there, with 64 nothing (docs/BENCHMARKS.md). A GPU stays bandwidth bound
    # to far larger batches: raise it there.
    "max_verify_tokens": 64,
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    model: str | None
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    rule: str
    max_verify_tokens: int


def parse_speculative(values: dict[str, Any]) -> SpeculativeConfig:
    """The settings in ``values``; ValueError naming the bad key ("speculative.KEY")."""
    if not isinstance(values, dict):
        raise ValueError(f"speculative must be a table (JSON object), got {values!r}")
    unknown = sorted(set(values) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(_DEFAULTS)}")
    merged = {**_DEFAULTS, **values}

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"speculative.{key} = {merged[key]!r}: {why}")

    if merged["method"] not in METHODS:
        raise bad("method", f"must be one of {', '.join(METHODS)}")
    if merged["method"] == "draft":
        if not isinstance(merged["model"], str) or not merged["model"].strip():
            raise bad("model", 'method "draft" needs the draft model\'s path or name')
        for key in _NGRAM_ONLY:
            if key in values:
                raise bad(key, 'only for method "ngram" (the draft model makes the guesses)')
    elif "model" in values:
        raise bad("model", 'only for method "draft"')
    if merged["rule"] not in RULES:
        raise bad("rule", f"must be one of {', '.join(RULES)}")
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = merged[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(key, "must be an integer >= 1")
    if merged["num_speculative_tokens"] > 16:
        raise bad("num_speculative_tokens", "must be <= 16")
    if merged["prompt_lookup_max"] < merged["prompt_lookup_min"]:
        raise bad("prompt_lookup_max", "must be >= prompt_lookup_min")
    limit = merged["max_verify_tokens"]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise bad("max_verify_tokens", "must be an integer >= 1")
    return SpeculativeConfig(**merged)
