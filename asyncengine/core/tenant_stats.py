"""Per-tenant counters (``SamplingParams.tenant``): requests, tokens, timeouts.

Prompt tokens count when a request is accepted, generated tokens when it ends (finished,
aborted, timed out or failed): counting them per token would cost every step a lookup per
sampled token.

Tenant names come from clients (the OpenAI ``user`` field), so the number of distinct series is
capped: tenants past ``max_tenants`` are counted together under ``OTHER``. Requests without a
tenant count under ``NO_TENANT``.
"""

from __future__ import annotations

from asyncengine.common.request import Request

NO_TENANT = ""
OTHER = "_other"
FIELDS = ("requests", "prompt_tokens", "generated_tokens", "finished_timeout")


class TenantStats:
    def __init__(self, max_tenants: int = 1000) -> None:
        self.max_tenants = max_tenants
        self.by_tenant: dict[str, dict[str, int]] = {}

    def _row(self, req: Request) -> dict[str, int]:
        tenant = req.params.tenant or NO_TENANT
        row = self.by_tenant.get(tenant)
        if row is None:
            if len(self.by_tenant) >= self.max_tenants:
                tenant = OTHER
                row = self.by_tenant.get(tenant)
            if row is None:
                row = self.by_tenant[tenant] = dict.fromkeys(FIELDS, 0)
        return row

    def added(self, req: Request) -> None:
        row = self._row(req)
        row["requests"] += 1
        row["prompt_tokens"] += len(req.prompt_ids)

    def generated(self, req: Request, tokens: int = 1) -> None:
        self._row(req)["generated_tokens"] += tokens

    def timed_out(self, req: Request) -> None:
        self._row(req)["finished_timeout"] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {tenant: dict(row) for tenant, row in self.by_tenant.items()}
