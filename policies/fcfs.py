"""fcfs: first come, first served."""

from __future__ import annotations

from policies.base import Policy


class FCFSPolicy(Policy):
    name = "fcfs"
    orders = True
