"""Host and Origin checks for connections that arrive over loopback.

A server on 127.0.0.1 is still reachable from the operator's browser: a web page can send it
requests (browser CSRF), and a page on a domain the attacker re-points at 127.0.0.1 (DNS
rebinding) can even read the answers. Both carry a name that is not loopback, so a request
that arrived on a loopback address is answered 403 when:

- its ``Host`` header is not ``localhost`` (or ``*.localhost``), a loopback address, this
  machine's host name, or one of the allowed hosts (``--allowed-host``, e.g. a proxy's), or
- it has an ``Origin`` header (browsers send one on cross-origin requests) whose host is not
  one of those (``Origin: null``, a sandboxed page, included).

Clients that are not browsers send no ``Origin``, and ``Host`` is the address they dialled.
Connections to a non-loopback address (``--host 0.0.0.0``) are not checked: there the API key
is what guards the server.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp import web

from asyncengine.server.errors import ApiError, Handler

ALLOWED_HOSTS = web.AppKey("asyncengine_allowed_hosts", frozenset)


def is_loopback(host: str) -> bool:
    """A loopback address or the name ``localhost`` (``*.localhost`` too, RFC 6761)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_name(authority: str) -> str:
    """The host of ``host[:port]`` / ``[v6]:port``, lower case."""
    return (urlsplit("//" + authority).hostname or "").rstrip(".")


def _allowed(host: str, extra: frozenset[str]) -> bool:
    return bool(host) and (is_loopback(host) or host in extra)


def _arrived_on_loopback(request: web.Request) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not sockname or not isinstance(sockname, tuple):
        return False  # a Unix socket or no transport: not a loopback TCP listener
    return is_loopback(str(sockname[0]))


@web.middleware
async def host_check_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not _arrived_on_loopback(request):
        return await handler(request)
    extra = request.app.get(ALLOWED_HOSTS, frozenset())
    host_header = request.headers.get("Host")
    if host_header is not None and not _allowed(_host_name(host_header), extra):
        return _forbidden(f"the Host header {host_header!r} is not a name of this server")
    origin = request.headers.get("Origin")
    if origin is not None and not _allowed((urlsplit(origin).hostname or ""), extra):
        return _forbidden(f"requests from the web origin {origin!r} are not accepted")
    return await handler(request)


def _forbidden(reason: str) -> web.Response:
    return ApiError(
        403,
        f"{reason[:300]}; a server on loopback answers only its own names (add a name with "
        "--allowed-host)",
        type="permission_error",
        code="host_not_allowed",
    ).response()


def allowed_hosts(hosts: Iterable[str]) -> frozenset[str]:
    """The operator's extra host names and this machine's own (which may resolve to a loopback
    address, as Debian's 127.0.1.1), as the check compares them (lower case, no port)."""
    names = [*hosts, socket.gethostname()]
    return frozenset(_host_name(h.strip().lower()) for h in names if h.strip())
