#!/bin/bash
# Builds kernels/cpu/cpu_{decode,extend}_attention.c for this CPU twice (float32 and -DKV_F16 pools)
# and compares them over the same pool (check.c). Exit status 0 when every shape agrees.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernels="$here/../../kernels"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
grep -m1 "model name" /proc/cpuinfo || true
flags="-O3 -march=native -fopenmp -shared -fPIC -std=c11"
gcc $flags "$kernels/cpu/cpu_decode_attention.c" -o "$work/dec32.so" -lm
gcc $flags -DKV_F16 "$kernels/cpu/cpu_decode_attention.c" -o "$work/dec16.so" -lm
gcc $flags "$kernels/cpu/cpu_extend_attention.c" -o "$work/ext32.so" -lm
gcc $flags -DKV_F16 "$kernels/cpu/cpu_extend_attention.c" -o "$work/ext16.so" -lm
gcc -O2 -march=native -std=c11 -I "$kernels" "$here/check.c" -o "$work/check" -ldl -lm
cd "$work" && ./check
