"""Client-chosen text in log lines (a percent-decoded path, a request id, a refusal's reason)
with every non-printable character escaped: a newline or terminal escape sent by a client cannot
forge a log line or repaint the operator's terminal."""

from __future__ import annotations

LOGGED_CHARS = 300  # longest client value written to a log line


def log_safe(text: str, limit: int = LOGGED_CHARS) -> str:
    """``text`` cut to ``limit`` characters, control and format characters written as escapes
    (``\\n``, ``\\x1b``, ``\\u2028``)."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
