#!/usr/bin/env bash
# Run scripts/peers/vllm/runner.py in the vLLM CPU virtualenv (scripts/setup_vllm_cpu.sh) with the
# environment vLLM's CPU backend wants; all arguments go to peers/vllm/runner.py, e.g.
#
#   scripts/peers/vllm/run.sh spec.json --out result.json
#   scripts/peers/vllm/run.sh --single-stream --model ~/.cache/asyncengine/smollm2-135m-bfloat16
#   VLLM_CPU_OMP_THREADS_BIND=0 scripts/peers/vllm/run.sh spec.json     # one core only
#
# Env (each can be overridden from outside): LD_PRELOAD = tcmalloc + the venv's libiomp5.so,
# VLLM_CPU_OMP_THREADS_BIND = all cores. The KV cache size is peers/vllm/runner.py's business
# (spec "kv_cache_gib" / --kv-gib, default 1 GiB), so VLLM_CPU_KVCACHE_SPACE is not set here.
set -euo pipefail
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/asyncengine/vllm-venv}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$VLLM_VENV/bin/python"
if [ ! -x "$py" ]; then
  echo "[peers/vllm/run.sh] ERROR: no vLLM venv at $VLLM_VENV; run scripts/setup_vllm_cpu.sh first" >&2
  exit 2
fi
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
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM 0.32's AOT compile cache fails to load on CPU and every start recompiles (~50 s);
# with it off, the older torch.compile cache (~/.cache/vllm) makes later starts fast.
export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"
export AE_VLLM_PEER_ENV_SET=1   # peers/vllm/runner.py: the env is set, no re-exec
unset VLLM_VENV   # ours, not vLLM's: vLLM warns about unknown VLLM_* variables
exec "$py" "$here/runner.py" "$@"
