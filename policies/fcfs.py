"""fcfs: first come, first served."""

from __future__ import annotations

from asyncengine.policies.base import Policy


class FCFSPolicy(Policy):
    name = "fcfs"
    orders = True
    sees_decodes = False  # Policy.sees_decodes: it reads no decode
