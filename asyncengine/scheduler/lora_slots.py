"""LoRA slots: at most ``max_loras`` distinct adapters among the requests a step may hold.

The adapters "in the step" are those of the running and mid-prompt requests: every one of them
can be a row of the next plan, so admission keeps their distinct adapters (the base model, None,
is not one) at or under ``max_loras`` and every plan holds at most that many. A waiting request
whose adapter is in the step joins freely; one whose adapter is new takes a free slot, and when
there is none it waits and admission goes on past it (a request of an adapter already in the
step, or of the base, may still join: no head-of-line blocking).

Never starving it: the first adapter refused a slot claims the next one. The in-step adapter
with the fewest rows (the quickest to leave) then drains: it admits no new request until its
rows finish, and the slot it frees is kept for the claimant; no other new adapter may take the
last free slot meanwhile. So a waiting adapter waits at most for one adapter's rows to finish,
however steady the others' traffic. A claim lapses when no request of the claimant is among the
requests the policy orders (aborted, timed out, or pushed out of the window by retracted
requests); it is made again when one of them is refused again.

A preempting policy (``lora-fair`` by default) may free a slot at once instead: admission asks
it for running requests to retract for the refused one (``Policy.preempt_candidates``), and
when it names every request of one adapter in the step, they are retracted (their computed
prefixes stay cached) and that adapter's slot goes to the refused one (admitter.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from asyncengine.common.request import Request


class LoraSlots:
    def __init__(self, max_loras: int, running: Sequence[Request], prefilling: Sequence[Request]):
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self._running = running  # the scheduler's lists (read, never changed here)
        self._prefilling = prefilling
        self.claimant: str | None = None  # the adapter refused first, waiting for a slot
        self.draining: str | None = None  # in the step, admitting nothing until it leaves
        self._rows: dict[str, int] | None = None  # adapter -> rows in the step (None: stale)
        self._steps = 0  # steps counted (new_step calls)
        self._since: dict[str, int] = {}  # adapter in the step -> the step it took its slot
        self.claims = 0  # claims made (each one drained an adapter)
        # a request with an adapter has arrived (the scheduler says): until then no step
        # holds one, and nothing is counted
        self.any_lora = False

    def new_step(self) -> None:
        """A new step begins: the adapters in it are counted again when first asked."""
        self._rows = None
        self._steps += 1

    @property
    def rows(self) -> dict[str, int]:
        """Adapter -> its requests in the step (running, mid-prompt, admitted so far)."""
        rows = self._rows
        if rows is None:
            rows = {}
            if not self.any_lora:
                return rows
            for group in (self._running, self._prefilling):
                for req in group:
                    lora = req.params.lora
                    if lora is not None:
                        rows[lora] = rows.get(lora, 0) + 1
            since = self._since
            for lora in [lora for lora in since if lora not in rows]:
                del since[lora]
            for lora in rows:
                since.setdefault(lora, self._steps)
            if self.draining is not None and self.draining not in rows:
                self.draining = None  # it left: its slot is free (kept for the claimant)
            if self.claimant is not None and self.claimant in rows:
                self.claimant = self.draining = None  # joined: the drain is over
            self._rows = rows
        return rows

    def in_step(self) -> frozenset[str]:
        """The adapters the step already holds."""
        return frozenset(self.rows)

    def renew(self, ordered: Iterable[Request]) -> None:
        """Drop a claim none of whose requests the policy ordered this step."""
        claimant = self.claimant
        if claimant is not None and not any(req.params.lora == claimant for req in ordered):
            self.claimant = self.draining = None

    def may_join(self, lora: str) -> bool:
        """Whether a request of adapter ``lora`` may be admitted now."""
        rows = self.rows
        if lora in rows:
            return lora != self.draining
        free = self.max_loras - len(rows)
        if self.claimant is not None and lora != self.claimant:
            free -= 1  # one slot is the claimant's
        return free > 0

    def joined(self, lora: str) -> None:
        """A request of ``lora`` was admitted."""
        rows = self.rows
        rows[lora] = rows.get(lora, 0) + 1
        self._since.setdefault(lora, self._steps)
        if lora == self.claimant:
            self.claimant = self.draining = None

    def left(self, lora: str) -> None:
        """Every request of ``lora`` in the step was retracted: its slot is free."""
        self.rows.pop(lora, None)
        self._since.pop(lora, None)
        if lora == self.draining:
            self.draining = None

    def refused(self, lora: str) -> None:
        """A request of ``lora`` could not join: the first such adapter claims a slot, and the
        in-step adapter that frees its slot soonest drains (the fewest tokens its longest
        request may still generate; then the one that has held its slot the longest)."""
        if self.claimant is not None:
            return
        self.claimant = lora
        self.claims += 1
        rows = self.rows
        if len(rows) >= self.max_loras:
            since = self._since
            left = self._tokens_left()
            self.draining = min(
                rows, key=lambda name: (left.get(name, 0), since.get(name, 0), name)
            )

    def _tokens_left(self) -> dict[str, int]:
        """Adapter in the step -> the most tokens one of its requests may still generate (a
        prompt still being computed counts as one more)."""
        left: dict[str, int] = {}
        for group, extra in ((self._running, 0), (self._prefilling, 1)):
            for req in group:
                lora = req.params.lora
                if lora is not None:
                    tokens = req.remaining_new_tokens + extra
                    if tokens > left.get(lora, -1):
                        left[lora] = tokens
        return left
