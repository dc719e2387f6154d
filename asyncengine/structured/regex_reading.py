"""Regex features of JSON Schema's ECMA-262 dialect that xgrammar's parser refuses: a
``pattern`` with one fails the whole grammar's compile (every tool of the request with it).
Found by a scan of the pattern (linear, cheap enough for the event loop), as the lookahead
that xgrammar drops is (schema_support.py); tests/structured/test_schema_support.py probes
xgrammar with each, so an upgrade that reads one shows there.
"""

from __future__ import annotations

import re

# each after an even run of backslashes (an escaped backslash is a plain character)
_FEATURES = re.compile(
    r"(?<!\\)(?:\\\\)*(?:(?P<boundary>\\[bB])|(?P<property>\\[pP]\{)|(?P<backreference>\\[k1-9])"
    r"|(?P<lookbehind>\(\?<[=!])|(?P<atomic>\(\?>)|(?P<open_count>\{,))"
)
_NAMES = {
    "boundary": "a word boundary (\\b)",
    "property": "a Unicode property class (\\p{...})",
    "backreference": "a backreference",
    "lookbehind": "a lookbehind",
    "atomic": "an atomic group",
    "open_count": "a repetition with no lower bound ({,n})",
}


def unreadable_pattern(pattern: str) -> str | None:
    """The first feature of ``pattern`` xgrammar cannot read, in words (None: none)."""
    if "\\" not in pattern and "(?" not in pattern and "{," not in pattern:
        return None  # most patterns: no scan
    found = _FEATURES.search(pattern)
    if found is None or found.lastgroup is None:
        return None
    return _NAMES[found.lastgroup]
