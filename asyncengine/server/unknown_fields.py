"""A warning naming the top-level fields of a request body that its type does not read.

Unknown fields are accepted (OpenAI clients send many this server has no use for), but a
misspelt one (``max_token``, ``temprature``) would otherwise change nothing without a word, so
each request that carries some gets one warning line naming them, as vLLM logs. The line is
bounded whatever the body holds: at most ``MAX_NAMED_FIELDS`` names, each cut to
``MAX_FIELD_NAME_CHARS`` and escaped, and nothing from the values.
"""

from __future__ import annotations

import functools
import logging

import msgspec

from asyncengine.server.log_safe import log_safe

log = logging.getLogger("asyncengine.server")

MAX_NAMED_FIELDS = 5
MAX_FIELD_NAME_CHARS = 40

_TOP_LEVEL_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


@functools.cache
def known_fields(request_type: type[msgspec.Struct]) -> frozenset[str]:
    """The names ``request_type`` reads from a JSON object (their encoded spelling)."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(request_type))


def unknown_fields(body: bytes, request_type: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of ``body`` (a JSON object ``request_type`` decoded) that it does
    not read, in body order; values are skipped, not decoded."""
    if request_type.__struct_config__.forbid_unknown_fields:
        return []  # the decode already refused any
    known = known_fields(request_type)
    return [key for key in _TOP_LEVEL_KEYS.decode(body) if key not in known]


def ignored_fields_message(path: str, names: list[str]) -> str:
    """The warning for ``names`` ignored on a request to ``path``, bounded in length."""
    shown = ", ".join(
        f"'{log_safe(name, MAX_FIELD_NAME_CHARS)}'" for name in names[:MAX_NAMED_FIELDS]
    )
    more = len(names) - MAX_NAMED_FIELDS
    suffix = f" and {more} more" if more > 0 else ""
    return (
        f"{log_safe(path, MAX_FIELD_NAME_CHARS)}: the following fields were present in the "
        f"request but ignored: {shown}{suffix}"
    )


def warn_unknown_fields(path: str, body: bytes, request_type: type[msgspec.Struct]) -> None:
    """Log one warning naming the fields of ``body`` that ``request_type`` ignores, if any."""
    names = unknown_fields(body, request_type)
    if names:
        log.warning("%s", ignored_fields_message(path, names))
