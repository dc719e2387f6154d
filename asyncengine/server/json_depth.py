"""How deeply a JSON text nests, found without decoding it (at C speed, bounded work).

The decoder recurses once per level; a body nested thousands of levels deep must be refused
before it gets there. No request body this server takes nests more than a few levels.
"""

from __future__ import annotations

import re

# the deepest nesting of arrays and objects a request body may have
MAX_JSON_DEPTH = 32

_STRUCTURE = b'[]{}"'
_OTHER_BYTES = bytes(b for b in range(256) if b not in _STRUCTURE)
_STRING = re.compile(rb'"[^"]*"')
_INNERMOST = re.compile(rb"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")


def nests_deeper_than(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body`` holds arrays/objects nested more than ``limit`` levels deep.

    Escaped backslashes and quotes go first, then every byte but brackets and quotes, then the
    strings (brackets inside them do not count); each pass then removes the innermost pairs, so
    the number of passes that remove something is the depth. Unbalanced text stops the passes
    early: the decoder then reports it as malformed.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _OTHER_BYTES)
    text = _STRING.sub(b"", text)
    for _ in range(limit + 1):
        text, removed = _INNERMOST.subn(b"", text)
        if not removed:
            return False
    return True
