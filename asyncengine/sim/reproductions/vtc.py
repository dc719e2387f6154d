"""VTC fairness (Sheng et al., OSDI 2024): FCFS serves clients in proportion to what they
send, the Virtual Token Counter gives backlogged clients equal service, within a bound.

Two clients send requests of one shape, client "b" at twice client "a"'s rate, together well
over what the engine serves. Service is counted as the paper counts it: ``w_p`` per prompt
token computed plus ``w_q`` per output token generated (1 and 2, the ``fair`` policy's
defaults). Over the time both clients have requests waiting (both backlogged), FCFS should
give "b" about twice "a"'s service and VTC (our ``fair`` policy) about the same; and VTC's
service difference over any interval in which both stay backlogged should stay within the
paper's bound 2U, U = max(w_p * L_input, w_q * M), with L_input the longest prompt and M the
most tokens a batch can hold (the KV pool).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncengine.common.config import EngineConfig
from asyncengine.common.plan import BatchPlan
from asyncengine.core.engine_core import EngineCore
from asyncengine.sim.clock import VirtualClock
from asyncengine.sim.reproductions.base import (
    Claim,
    Outcome,
    markdown_table,
    run_workload,
    seconds,
)
from asyncengine.workloads.arrivals import Arrivals
from asyncengine.workloads.generators import _tokens
from asyncengine.workloads.trace import WorkloadRequest

PREFILL_WEIGHT = 1.0  # w_p
OUTPUT_WEIGHT = 2.0  # w_q
CLIENTS = ("a", "b")


def two_clients(
    rate_a: float,
    duration: float,
    prompt_len: int,
    output_len: int,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Client "a" at ``rate_a`` and "b" at twice it, Poisson, for ``duration`` seconds."""
    rng = np.random.default_rng(seed)
    items = []
    for index, (client, rate) in enumerate((("a", rate_a), ("b", 2 * rate_a))):
        count = int(rate * duration)
        times = Arrivals("poisson", rate=rate).times(count, seed * 31 + index)
        for i, t in enumerate(times):
            items.append(
                WorkloadRequest(
                    f"{client}-{i:05d}",
                    t,
                    _tokens(rng, prompt_len, vocab_size),
                    output_len,
                    tenant=client,
                )  # fmt: skip
            )
    items.sort(key=lambda w: (w.arrival_time, w.rid))
    return items


@dataclass(slots=True)
class ServiceMeter:
    """Per step: each client's cumulative service and whether both had requests waiting."""

    core: EngineCore
    clock: VirtualClock
    tenant_of: dict[str, str]
    service: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLIENTS, 0.0))
    # (time, service of a, service of b, both backlogged) after every step
    samples: list[tuple[float, float, float, bool]] = field(default_factory=list)

    def __call__(self, plan: BatchPlan) -> None:
        service, tenant_of = self.service, self.tenant_of
        for seg in plan.extends:
            client = tenant_of[seg.rid]
            service[client] += PREFILL_WEIGHT * seg.num_tokens + OUTPUT_WEIGHT * seg.sample
        for seg in plan.decodes:
            service[tenant_of[seg.rid]] += OUTPUT_WEIGHT
        waiting = {req.params.tenant for req in self.core.scheduler.waiting}
        self.samples.append(
            (self.clock.now, service["a"], service["b"], all(c in waiting for c in CLIENTS))
        )

    def backlogged(self) -> tuple[float, float, float, float]:
        """Over the steps that end with both clients backlogged: seconds, service of a and of
        b, and the largest |service difference| over any interval inside one such stretch."""
        span = got_a = got_b = worst = 0.0
        previous = (0.0, 0.0, 0.0, False)
        low = high = 0.0
        for sample in self.samples:
            t, a, b, both = sample
            if both and previous[3]:  # the step from previous to here ran with both backlogged
                span += t - previous[0]
                got_a += a - previous[1]
                got_b += b - previous[2]
                low, high = min(low, b - a), max(high, b - a)
                worst = max(worst, high - low)
            elif both:  # a stretch starts here
                low = high = b - a
            previous = sample
        return span, got_a, got_b, worst


def meter_factory(
    tenant_of: dict[str, str], meters: list[ServiceMeter]
) -> Callable[[EngineCore, VirtualClock], ServiceMeter]:
    def build(core: EngineCore, clock: VirtualClock) -> ServiceMeter:
        meter = ServiceMeter(core, clock, tenant_of)
        meters.append(meter)
        return meter

    return build


class VTCFairness:
    name = "vtc"
    title = "VTC: equal service for backlogged clients (Sheng et al., OSDI 2024)"
    claim = Claim(
        text=(
            "With one client sending at twice the other's rate into an overloaded server, FCFS "
            "serves the clients in proportion to their load while the Virtual Token Counter "
            "gives them equal service; between two backlogged clients VTC's service difference "
            "over any interval is at most 2U, U = max(w_p * L_input, w_q * M) (L_input: the "
            "longest prompt, M: the most tokens in a running batch)."
        ),
        source="Sheng et al., Fairness in Serving Large Language Models, OSDI 2024, §4-5",
        url="https://arxiv.org/abs/2401.00588",
    )

    def run(self, real: bool) -> Outcome:
        if real:
            prompt_len, output_len, rate_a, duration, pool = 64, 32, 3.0, 40.0, 4096
        else:
            prompt_len, output_len, rate_a, duration, pool = 256, 128, 1.2, 600.0, 8192
        workload = two_clients(rate_a, duration, prompt_len, output_len)
        tenant_of = {w.rid: str(w.tenant) for w in workload}
        base = EngineConfig(kv_cache_tokens=pool, log_interval=0.0)
        bound = 2 * max(PREFILL_WEIGHT * prompt_len, OUTPUT_WEIGHT * pool)
        window = len(workload)  # the policy orders the whole waiting queue
        variants = {
            "fcfs": ("FCFS", base.replace(policy="fcfs")),
            "fair": (
                f"VTC (`fair`, default `policy_window` {base.policy_window})",
                base.replace(policy="fair"),
            ),
            "fair-whole-queue": (
                f"VTC (`fair`, `policy_window` {window})",
                base.replace(policy="fair", policy_window=window),
            ),
        }
        rows, numbers = [], {}
        for key, (label, config) in variants.items():
            meters: list[ServiceMeter] = []
            run = run_workload(
                key, config, workload, real=real, hook=meter_factory(tenant_of, meters)
            )
            span, got_a, got_b, worst = meters[0].backlogged()
            ttft = {
                c: [r.ttft for r in run.records if r.tenant == c and r.ttft is not None]
                for c in CLIENTS
            }
            median = {c: float(np.median(v)) if v else float("nan") for c, v in ttft.items()}
            ratio = got_b / got_a if got_a else float("nan")
            numbers[key] = {
                "backlogged_seconds": span,
                "service_a": got_a,
                "service_b": got_b,
                "service_ratio_b_over_a": ratio,
                "max_service_difference": worst,
                "bound_2U": bound,
                "ttft_p50_a": median["a"],
                "ttft_p50_b": median["b"],
                "completed": run.summary.num_completed,
                "output_throughput": run.summary.output_throughput,
            }
            vtc = key != "fcfs"
            rows.append([
                label,
                "1 : 1" if vtc else "1 : 2",
                f"1 : {ratio:.2f}",
                f"{worst:,.0f}",
                f"{bound:,.0f}" if vtc else "none",
                seconds(median["a"]),
                seconds(median["b"]),
                f"{run.summary.output_throughput:.1f}",
            ])  # fmt: skip
        fcfs, windowed, fair = (numbers[k] for k in variants)
        windowed_holds = (
            abs(windowed["service_ratio_b_over_a"] - 1.0) < 0.1
            and windowed["max_service_difference"] <= bound
        )
        holds = (
            windowed_holds
            and abs(fcfs["service_ratio_b_over_a"] - 2.0) < 0.3
            and abs(fair["service_ratio_b_over_a"] - 1.0) < 0.1
            and fair["max_service_difference"] <= bound
            and min(fcfs["backlogged_seconds"], fair["backlogged_seconds"]) > 0
        )
        setting = (
            f"Two clients, every request {prompt_len} prompt tokens and {output_len} output "
            f"tokens; client a Poisson at {rate_a:g} req/s and client b at {2 * rate_a:g} req/s "
            f"for {duration:g} s ({len(workload)} requests), together more than the engine "
            f"serves; KV pool M = {pool} tokens, engine defaults otherwise. Service = "
            f"{PREFILL_WEIGHT:g} per prompt token computed + {OUTPUT_WEIGHT:g} per output token, "
            "counted at every step; the shares are over the steps during which both clients "
            "had requests waiting (FCFS: "
            f"{fcfs['backlogged_seconds']:.0f} s, VTC: {fair['backlogged_seconds']:.0f} s)."
        )
        table = markdown_table(
            [
                "policy",
                "paper: service a : b",
                "ours: service a : b (both backlogged)",
                "ours: max service difference",
                "paper's bound 2U",
                "TTFT p50 a",
                "TTFT p50 b",
                "out tok/s",
            ],
            rows,
        )
        verdict = (
            f"FCFS gives client b {fcfs['service_ratio_b_over_a']:.2f}x client a's service "
            f"(its share of the load). VTC ordering the whole queue gives it "
            f"{fair['service_ratio_b_over_a']:.2f}x, and the largest service difference over an "
            "interval in which both stayed backlogged is "
            f"{fair['max_service_difference']:,.0f}, "
            f"{fair['max_service_difference'] / bound:.0%} of the bound 2U = {bound:,.0f} "
            f"(under FCFS the difference grows with time: {fcfs['max_service_difference']:,.0f}). "
            f"With the engine's default `policy_window` ({base.policy_window}: `fair` orders each "
            "client's oldest waiting requests, a window per client: `Policy.candidates`) VTC "
            "gives b "
            f"{windowed['service_ratio_b_over_a']:.2f}x a's service and a difference of "
            f"{windowed['max_service_difference']:,.0f}, "
            f"{windowed['max_service_difference'] / bound:.0%} of the bound"
            + (
                ""
                if windowed_holds
                else ", **past it**: the window hides what the policy needs to see"
            )
            + "."
        )
        return Outcome(setting, table, verdict, holds, numbers)
