#!/usr/bin/env bash
# Regenerate everything in docs/experiments/ (see docs/EXPERIMENTS.md).
#
#   scripts/run_experiments.sh            # simulator runs (about 25 s of one core)
#   scripts/run_experiments.sh --real     # also the simulator-vs-real check (a few minutes)
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

compare() {  # compare NAME ARGS...: one simulated comparison into $OUT/NAME
    local name=$1
    shift
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
#    chunked prefill and mixed batches on and off.
compare long_short --workload long_short --arrivals interval:1 \
    --configs "${POLICIES[@]}" "$EXTRA/fcfs-no-chunk.toml" "$EXTRA/fcfs-no-mixed.toml" \
    "$EXTRA/fcfs-no-chunk-no-mixed.toml" "$EXTRA/fcfs-chunk-256.toml"

# 6. The simulator against the real engine (SmolLM2-135M, bf16, one torch thread).
if [[ "${1:-}" == "--real" ]]; then
    "$PY" scripts/sim_check.py --out "$OUT/sim_vs_real"
fi
