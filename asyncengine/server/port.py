"""Is the port free? Checked before the model loads, so that a taken port costs one line, not a
model load and a traceback."""

from __future__ import annotations

import errno
import socket


class PortInUseError(OSError):
    """The address to serve on is taken by another process."""

    def __init__(self, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is in use; pass --port")
        self.port = port

    def __str__(self) -> str:
        return str(self.strerror)


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if a listener holds ``host:port`` (port 0 is always free). Binds
    as the server will (SO_REUSEADDR), so a port left in TIME_WAIT counts as free."""
    if port == 0:
        return
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(port) from None
                raise
