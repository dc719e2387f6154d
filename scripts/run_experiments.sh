#!/usr/bin/env bash
# Regenerate everything in docs/experiments/ (see docs/EXPERIMENTS.md).
#
#   scripts/run_experiments.sh            # simulator runs (a few minutes of one core)
#   scripts/run_experiments.sh --real     # also the simulator-vs-real check (a few minutes)
#   ONLY="multi_tenant slo" scripts/run_experiments.sh   # just these experiments
#
# Every workload is seeded (--seed 0), so the simulator runs give the same numbers on any
# machine; the real check measures this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=docs/experiments
POLICIES=(configs/fcfs.toml configs/lpm.toml configs/dfs-weight.toml
          configs/token-budget.toml configs/dynamic-chunking.toml)
EXTRA=$OUT/configs

ONLY=${ONLY:-}

compare() {  # compare NAME ARGS...: one simulated comparison into $OUT/NAME
    local name=$1
    shift
    if [[ -n "$ONLY" && " $ONLY " != *" $name "* ]]; then return; fi
    "$PY" scripts/compare_policies.py --sim --seed 0 --out "$OUT/$name" "$@"
    rm -f "$OUT/$name/workload.jsonl"  # regenerated from the seed; keeps the docs small
}

# 1. Independent prompts (ShareGPT-like lengths), Poisson arrivals near saturation.
compare random --workload random --workload-arg num_requests=300 --arrivals poisson:1 \
    --configs "${POLICIES[@]}"

# 2. Few-shot serving: 8 prompts of 1024 tokens, 32 questions each, shuffled, all queued at
#    once; the KV pool (4096 tokens) holds fewer than half of the shared prompts.
compare shared_prefix --workload shared_prefix --arrivals burst \
    --configs "${POLICIES[@]}" --set kv_cache_tokens=4096

# 2b. The same requests arriving at 2 per second: LPM's aging now matters.
compare shared_prefix_poisson --workload shared_prefix --arrivals poisson:2 \
    --configs "${POLICIES[@]}" --set kv_cache_tokens=4096

# 3. Chat: 32 conversations x 4 turns, turn by turn, 4 requests per second; the pool (16384
#    tokens) holds every conversation.
compare multi_turn --workload multi_turn --arrivals poisson:4 \
    --configs "${POLICIES[@]}" --set kv_cache_tokens=16384

# 4. Tree of thought: 4 trees of depth 3, branching 3 (160 requests), all queued at once,
#    issued breadth first; the pool (4096 tokens) is smaller than the trees (~11k tokens).
compare tree_of_thought --workload tree_of_thought --arrivals burst \
    --configs "${POLICIES[@]}" --set kv_cache_tokens=4096

# 5. Long/short mix: three 32-token prompts then one of 2048, one request a second;
#    chunked prefill, mixed batches and the short-prompt lane on and off.
compare long_short --workload long_short --arrivals interval:1 \
    --configs "${POLICIES[@]}" "$EXTRA/fcfs-no-chunk.toml" "$EXTRA/fcfs-no-mixed.toml" \
    "$EXTRA/fcfs-no-chunk-no-mixed.toml" "$EXTRA/fcfs-chunk-256.toml" \
    "$EXTRA/fcfs-no-lane.toml"

# 5b. The same requests tagged by class (tenant "short" or "long"), so that --group-by gives
#     the short requests' TTFT apart from the long ones': the lane on and off, and the budgets.
if [[ -z "$ONLY" || " $ONLY " == *" long_short_by_class "* ]]; then
    TAGGED=$OUT/long_short_by_class/workload.jsonl  # compare removes it after the run
    mkdir -p "$OUT/long_short_by_class"
    "$PY" - "$TAGGED" <<'PYEOF'
import sys
from asyncengine.workloads import Arrivals, make_workload, save_trace
requests = make_workload("long_short", seed=0, arrivals=Arrivals.parse("interval:1"))
for r in requests:
    r.tenant = "long" if len(r.prompt_ids) > 256 else "short"
save_trace(sys.argv[1], requests)
PYEOF
    compare long_short_by_class --workload "$TAGGED" --group-by tenant --no-figures \
        --configs configs/fcfs.toml "$EXTRA/fcfs-no-lane.toml" configs/token-budget.toml \
        configs/dynamic-chunking.toml "$EXTRA/fcfs-chunk-256.toml"
fi

# 7. Two tenants: "heavy" sends 600-token prompts at 1.2 per second (more than the engine
#    serves), "light" 60-token prompts at 0.12 per second.
compare multi_tenant --workload multi_tenant \
    --workload-arg num_heavy=200 num_light=20 heavy_rate=1.2 light_rate=0.12 \
    --policies fcfs sjf fair --configs "$EXTRA/sjf-aging-0.1.toml" --group-by tenant

# 8. Priorities: 20% interactive requests (priority 0, 16-token answers) among batch ones
#    (priority 1, 128 tokens), 300 requests at 2 per second (more than the engine serves).
compare priority_mix --workload priority_mix --workload-arg num_requests=300 rate=2.0 \
    --policies fcfs priority --configs "$EXTRA/priority-preempt.toml" --group-by priority

# 9. Latency targets (TTFT 5 s, ITL 250 ms): chat prompts and 10% long documents, 300
#    requests at 0.8 per second; FCFS with the SLO policy in the shadow, and (--shadow) the
#    shadow run live.
compare slo --workload slo_mix --workload-arg num_requests=300 rate=0.8 \
    --policies fcfs dynamic-chunking --configs "$EXTRA/slo.toml" "$EXTRA/fcfs-shadow-slo.toml" \
    --shadow --slo ttft_ms=5000 tpot_ms=250

# 10. The starvation check of every built-in policy (and of the variants that bound waits).
if [[ -z "$ONLY" || " $ONLY " == *" starvation "* ]]; then
    mkdir -p "$OUT/starvation"
    check() {  # check NAME POLICY OPTIONS
        "$PY" scripts/check_policy.py "$2" --options "$3" --examples 10 -q \
            --json "$OUT/starvation/$1.json" > /dev/null || true
    }
    check fcfs fcfs '{}'
    check lpm lpm '{}'
    check lpm-aging-0.1 lpm '{"aging": 0.1}'
    check dfs-weight dfs-weight '{}'
    check priority priority '{}'
    check priority-cap-5000 priority '{"max_wait_tokens": 5000}'
    check sjf sjf '{}'
    check fair fair '{}'
    check slo slo '{"ttft_ms": 5000.0, "itl_ms": 250.0}'
    "$PY" - "$OUT/starvation" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| policy | options | verdict | adversaries | worst wait (prefill tokens) | worst overtaking (prefill tokens) | failure |",
        "|---|---|---|---:|---:|---:|---|"]
for path in sorted(out.glob("*.json")):
    r = json.loads(path.read_text())
    rows.append(f"| `{r['policy']}` | `{json.dumps(r['options'])}` | {'passed' if r['passed'] else 'FAILED'} | "
                f"{r['examples']} | {r['worst_wait_tokens']} | {r['worst_overtaken_tokens']} | {r['failure'] or ''} |")
(out / "results.md").write_text("# Starvation check (scripts/check_policy.py, 10 drawn adversaries each)\n\n" + "\n".join(rows) + "\n")
PYEOF
fi

# 6. The simulator against the real engine (SmolLM2-135M, bf16, one torch thread).
if [[ "${1:-}" == "--real" ]]; then
    "$PY" scripts/sim_check.py --out "$OUT/sim_vs_real"
fi
