"""aiohttp logs a request it cannot parse (a NUL in a header, a bad method line) at ERROR with
a traceback, although the client got its 400 and the server is fine: log it at INFO, in one
escaped line."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

AIOHTTP_SERVER_LOGGER = "aiohttp.server"


class ClientErrorFilter(logging.Filter):
    """Rewrites records of client errors (an HttpProcessingError with a 4xx code) in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else None
            record.msg = "bad request from %s (HTTP %d): %s"
            record.args = (remote, exc.code, ascii(exc.message)[1:-1][:300])
            record.levelno = logging.INFO
            record.levelname = logging.getLevelName(logging.INFO)
            record.exc_info = None
            record.exc_text = None
        return True


def log_client_errors_quietly() -> None:
    """Install the filter on aiohttp's server logger (once)."""
    logger = logging.getLogger(AIOHTTP_SERVER_LOGGER)
    if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
        logger.addFilter(ClientErrorFilter())
