#!/usr/bin/env bash
# Every GPU figure in one call of the device tool (under 8 minutes on an H100/H200).
#
# Before (here, with network): scripts/gpu_wheels.sh   -> .whl/ and .gpu_model/ (git-ignored)
# Device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu_model"],
#                   timeout_s=480)     (the script holds itself to BUDGET=450 s, below)
# Dry run (here, on CPU; a tiny model, small counts; checks syntax, imports and arguments):
#               bash scripts/gpu_check.sh --dry-run
#
# Parts, most valuable first, each under its own timeout so that a hang loses only that part:
#   (0) the tests marked `gpu` (pytest -m gpu: the engine on CUDA against HF, compiled Triton
#       kernels and graph replay, FlashInfer), their output in tests.txt
#   (a) the 256-request offline benchmark (bench_offline.py, asyncengine only), then the same
#       with enable_overlap_schedule (steps planned while the last one runs: target >= 20k
#       tok/s on an H200); after (c), the stand-in executor on this machine's quiet CPU: host
#       ms/step at decode batch 256 (target <= 2) and, with --device-ms DEVICE_MS --overlap,
#       step wall over max(host, device) (<= 1.1); then the host split (profile_step.py)
#   (b) the decode step at batch 1/64/256 against the CUDA-graph replay floor and the
#       weight-read bound (gpu_check.py decode; target at 256: step <= 1.3x the bound)
#   (s) TTFT and ITL at 64 concurrent streams: `asyncengine serve` with the overlap schedule
#       on, 256 requests over loopback (bench_serving.py --max-concurrency 64)
#   (c) deterministic mode on CUDA: greedy tokens alone vs batched, and its offline tok/s
#       against the default mode's (bench_deterministic.py; target >= 0.5x)
#   (d) FlashInfer: JIT compile, the backend against the torch backend, timed against Triton
# Weights are random (the 98 MB GGUF cannot travel): the benchmarks ignore EOS, so speed does
# not depend on them. Output under $OUT: log.txt (everything printed), results.json (every
# part's full JSON, by part: offline, profile, host_step, decode, deterministic, flashinfer,
# offline_overlap, host_step_overlap, serving) and summary.txt (the table, also printed
# last). Each part writes its JSON under $OUT/parts/ first; the summary merges them into
# results.json and removes parts/.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT/parts"
P=$OUT/parts
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
START=$SECONDS
# BUDGET: seconds for the whole script (default 450 on the GPU): each part's limit is cut to
# what is left of it (less 15 s for the summary), so FlashInfer, last, gets the rest. Keep it
# under the device call's timeout_s.

if [ $DRY = 1 ]; then
    PY=${PY:-.venv/bin/python}
    MODEL=$(mktemp -d)/model
    DEVICE=cpu DTYPE=float32
    T_A=240 T_B=120 T_C=240 T_D=120 T_S=180 T_TESTS=120
    BUDGET=${BUDGET:-1200}
    N_REQ=8 N_DET=4 DET_REPEATS=1
    # the FlashInfer wheel only (the others are cp312 builds), to check its import and our layout
    if ls .whl/flashinfer_python-*.whl > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
            --target /tmp/gpu_check_site .whl/flashinfer_python-*.whl && export PYTHONPATH=/tmp/gpu_check_site
    fi
else
    PY=python3
    MODEL=/tmp/gpu_check_model
    DEVICE=cuda DTYPE=bfloat16
    T_A=150 T_B=75 T_C=75 T_D=400 T_S=120 T_TESTS=200  # each cut to what is left of BUDGET
    BUDGET=${BUDGET:-450}
    N_REQ=256 N_DET=16 DET_REPEATS=1
    # Packages the GPU image lacks (msgspec, gguf, flashinfer-python), then ours, editable so
    # that asyncengine.kernels / asyncengine.policies map to kernels/ and policies/.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site
    # (if the image's setuptools cannot build it, the same mapping as links in this scratch copy)
    if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
        echo "editable install failed: linking asyncengine/kernels and asyncengine/policies instead"
        ln -sfn ../kernels asyncengine/kernels
        ln -sfn ../policies asyncengine/policies
        export PYTHONPATH=$PWD:/tmp/site
    fi
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" -c "import torch, triton, asyncengine, asyncengine.kernels, asyncengine.policies; \
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    || { echo "imports failed"; exit 1; }

part() {  # part NAME SECONDS COMMAND...: run with a timeout, say how it ended
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - 15 - (SECONDS - START)))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        echo "=== $name: skipped, only ${left}s of the budget left ==="
        return
    fi
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s, at $((SECONDS - START))s) ==="
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s ==="
}

# (0) the GPU tests (skipped on a CPU: the dry run checks only that they are collected)
part tests "$T_TESTS" bash -c "set -o pipefail; \"$PY\" -m pytest -q -m gpu -p no:cacheprovider \
    tests/api/test_engine_cuda.py tests/executor/test_triton_model.py tests/executor/test_flashinfer_backend.py \
    2>&1 | tee \"$OUT/tests.txt\""

TINY=""
[ $DRY = 1 ] && TINY="--tiny"
part model 90 "$PY" scripts/gpu_check.py model .gpu_model "$MODEL" $TINY

# (a) the offline benchmark: the command of docs/BENCHMARKS.md "On an H100", asyncengine only
part offline "$T_A" "$PY" scripts/bench_offline.py --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --num-requests "$N_REQ" --systems asyncengine \
    --engine-arg max_running_requests=256 --engine-arg kv_cache_tokens=262144 \
    --no-progress --out "$P/offline.json"
part offline-overlap "$T_A" "$PY" scripts/bench_offline.py --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --num-requests "$N_REQ" --systems asyncengine \
    --engine-arg max_running_requests=256 --engine-arg kv_cache_tokens=262144 \
    --engine-arg enable_overlap_schedule=true --no-progress --out "$P/offline_overlap.json"

# (b) the decode step
BATCHES=1,64,256
[ $DRY = 1 ] && BATCHES=1,4
part decode "$T_B" "$PY" scripts/gpu_check.py decode "$MODEL" --batches "$BATCHES" \
    --out "$P/decode.json"

# (s) TTFT / ITL at 64 concurrent streams, the overlap schedule on
part serving-64 "$T_S" "$PY" scripts/bench_serving.py --launch --model "$MODEL" \
    --num-requests "$N_REQ" --max-concurrency 64 --arrivals burst --warmup 8 \
    --server-log "$OUT/serve.log" --no-progress --out "$P/serving.json" -- \
    --device "$DEVICE" --dtype "$DTYPE" --max-running-requests 256 \
    --kv-cache-tokens 262144 --overlap-schedule

# (c) deterministic mode: greedy tokens alone vs batched, on CUDA
part deterministic "$T_C" "$PY" scripts/bench_deterministic.py --model "$MODEL" \
    --device "$DEVICE" --dtype "$DTYPE" --num-requests "$N_DET" --check 8 \
    --repeats "$DET_REPEATS" --out "$P/deterministic.json"

# (a) diagnostics: the stand-in executor on this machine's quiet CPU, then the offline run's
# host split (a second, instrumented run)
part host-step 40 "$PY" scripts/micro/bench_host_step.py --quick --tokenizer .gpu_model \
    --out "$P/host_step.json"
# DEVICE_MS: the device's batch-256 decode step (1.6 ms: the last H200 figure; (b) re-measures it)
part host-step-overlap 40 "$PY" scripts/micro/bench_host_step.py --batches 256 \
    --mixed-requests 0 --tokenizer .gpu_model --device-ms "${DEVICE_MS:-1.6}" --overlap \
    --out "$P/host_step_overlap.json"

part host-split 90 "$PY" scripts/profile_step.py --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" --num-requests "$N_REQ" --no-replay \
    --workload-arg input_median=180 --workload-arg output_median=120 \
    --engine-arg max_running_requests=256 --engine-arg kv_cache_tokens=262144 \
    --out "$P/profile.json"

# (d) FlashInfer last: its kernels JIT-compile with nvcc (minutes)
part flashinfer "$T_D" "$PY" scripts/gpu_check.py attention --out "$P/flashinfer.json"

echo "=== total $((SECONDS - START))s ==="
SUMMARY_FLAGS=""
[ $DRY = 1 ] && SUMMARY_FLAGS="--dry-run"
"$PY" scripts/gpu_check.py summary "$OUT" $SUMMARY_FLAGS
