#!/usr/bin/env bash
# Prepare, on this (networked) machine, what scripts/gpu_check.sh needs on a lent GPU machine
# that has no network: wheels of the packages its image lacks, and the embedded model's config
# and tokenizer (the 98 MB GGUF cannot travel; gpu_check.sh builds random weights of its shape).
#
#   scripts/gpu_wheels.sh            # writes .whl/ and .gpu_model/ (both git-ignored), ~10 MB
#
# Then, with the device tool: carry [".whl", ".gpu_model"], command `bash scripts/gpu_check.sh`.
#
# - msgspec (asyncengine.common.config imports it) and gguf (the loader imports it): cp312 wheels.
# - flashinfer-python 0.3.1.post1: its sdist (3.8 MB), built here into a pure-Python wheel
#   without build isolation (no kernels are compiled: FlashInfer JIT-compiles them with nvcc on
#   first use, there). Its other needs (einops, click, tabulate, requests, nvidia-ml-py, ninja,
#   packaging) are in the GPU image; nvidia-cudnn-frontend is only for its cuDNN paths.
# - xgrammar is imported lazily (structured output only): not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHL=.whl
MODEL_DIR=.gpu_model
mkdir -p "$WHL" "$MODEL_DIR"
rm -f "$WHL"/*.whl

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHL" msgspec==0.22.0 gguf==0.19.0

sdist_dir=$(mktemp -d)
trap 'rm -rf "$sdist_dir"' EXIT
"$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$sdist_dir" \
    flashinfer-python==0.3.1.post1
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHL" "$sdist_dir"/flashinfer_python-*.tar.gz

# config.json from the GGUF metadata (no weights dequantized) and the tokenizer files
"$PY" - "$MODEL_DIR" <<'EOF'
import json
import shutil
import sys
from pathlib import Path

import torch
from gguf import GGUFReader

from asyncengine.executor.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS, tokenizer_dir
from asyncengine.executor.loader.gguf_loader import hf_config, read_metadata

out = Path(sys.argv[1])
gguf_path = KNOWN_MODELS[DEFAULT_MODEL].gguf_path()
reader = GGUFReader(gguf_path)
config = hf_config(read_metadata(reader), {t.name for t in reader.tensors}, torch.bfloat16)
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
for path in tokenizer_dir(DEFAULT_MODEL).iterdir():
    shutil.copy(path, out / path.name)
print(f"{out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
EOF

du -sh "$WHL" "$MODEL_DIR"
ls "$WHL"
