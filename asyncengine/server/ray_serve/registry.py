"""The routers of this process by application name, for the HTTP side to read.

Its own module because Ray Serve pickles the router's module by value (each process gets a
copy of it); state kept here is this process's, shared by every copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

_ROUTERS: dict[str, Any] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    request_id: str
    replica_id: str
    reason: str
    matched_tokens: int


def register(app_name: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS[app_name] = router


def router_for(app_name: str) -> Any:
    """This process's AsyncEngineRequestRouter of ``app_name`` (None before the first call
    through a handle makes it)."""
    with _LOCK:
        return _ROUTERS.get(app_name)
