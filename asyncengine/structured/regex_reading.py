"""Regex features of JSON Schema's ECMA-262 dialect that xgrammar's parser refuses: a
``pattern`` with one fails the whole grammar's compile (every tool of the request with it).
Found by a scan of the pattern (linear, cheap enough for the event loop), as the lookahead
that xgrammar drops is (schema_support.py); tests/structured/test_schema_support.py probes
xgrammar with each, inside and outside a character class, so an upgrade that reads one shows
there.

Inside a class (``[...]``) xgrammar reads them all, as ECMA-262 does: ``[\\b]`` is a backspace,
``[\\B]``, ``[\\1]``, ``[(?<=]`` and ``[{,]`` their characters. All but one: ``[\\p{L}]``, which
xgrammar takes as the characters ``p``, ``{``, ``L`` and ``}``, where JSON Schema reads patterns
with Unicode semantics (a letter): that one is refused inside a class too.
"""

from __future__ import annotations

import re

# a class, taken whole (as ECMA-262, "]" right after "[" closes it); an escape, taken as a pair
# (an escaped backslash is a plain character); the features outside a class
_TOKENS = re.compile(
    r"(?P<class>\[(?:\\.|[^\]\\])*\]?)|(?P<boundary>\\[bB])|(?P<property>\\[pP]\{)"
    r"|(?P<backreference>\\[k1-9])|\\.|(?P<lookbehind>\(\?<[=!])|(?P<atomic>\(\?>)"
    r"|(?P<open_count>\{,)",
    re.DOTALL,
)
_PROPERTY_IN_CLASS = re.compile(r"(?<!\\)(?:\\\\)*\\[pP]\{")
_NAMES = {
    "boundary": "a word boundary (\\b)",
    "property": "a Unicode property class (\\p{...})",
    "property_in_class": (
        "a Unicode property class (\\p{...}) inside [...], which xgrammar reads as its "
        "characters one by one"
    ),
    "backreference": "a backreference",
    "lookbehind": "a lookbehind",
    "atomic": "an atomic group",
    "open_count": "a repetition with no lower bound ({,n})",
}


def unreadable_pattern(pattern: str) -> str | None:
    """The first feature of ``pattern`` xgrammar cannot read, in words (None: none)."""
    if "\\" not in pattern and "(?" not in pattern and "{," not in pattern:
        return None  # most patterns: no scan
    for token in _TOKENS.finditer(pattern):
        kind = token.lastgroup
        if kind == "class":
            if _PROPERTY_IN_CLASS.search(token.group(), 1) is not None:
                return _NAMES["property_in_class"]
        elif kind is not None:
            return _NAMES[kind]
    return None
