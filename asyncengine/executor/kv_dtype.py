"""The K/V pool's element type: the ``kv_cache_dtype`` config key resolved for a model.

``"auto"``: float16 on a CPU where the model keeps quantized weights (a GGUF's blocks, int8),
its activations are float32 and every native kernel that touches the pool reads float16 through
F16C on AVX2 + FMA, not in deterministic mode; the model's dtype otherwise (as before: dense
checkpoints, GPUs, bfloat16 models). Why: a decode of a long context streams every key and
value of its request per layer, and at the offline mix's mean context (~440 keys) that
attention was ~40% of a CPU step; a half pool halves those bytes and the pool's memory. It is
also what llama.cpp keeps by default (f16 K/V), so quantized-model comparisons stay like for
like. Rounding K/V to half moves the model's logits a little (tests/executor/test_kv_cache_dtype.py
reports the greedy agreement with a float32 pool). AVX-512 builds read a float16 pool through
their per-item decode loop (the register-resident items are float32/bfloat16 only), which is
not measured yet, so ``auto`` keeps float32 there.

An explicit value must be honoured or refused: the model's own dtype always; float16 on a CPU
beside float32 activations (the kernels' -DKV_F16 builds, or the torch references where no
kernel runs), not in deterministic mode (its torch fallback reads the pool in the model's
dtype). ``int8`` (a scale per token and head: kernels/reference/kv_int8_ref.py) likewise: on a
CPU beside float32 or bfloat16 activations, with the torch attention backend (the native
kernels' -DKV_I8 builds, which take bfloat16 queries and outputs too; the torch references
dequantizing to the queries' dtype where no kernel runs), deterministic mode too (its native
extend kernel reads int8 rows, its torch fallback dequantizes each row alone); the Triton and
FlashInfer kernels do not read it, so on CUDA it is refused. ``auto`` does not pick int8 on
any ISA yet: its perplexity is within 0.5% of the 16-bit pools' (scripts/kv_int8_accuracy.py,
--dtype bfloat16 for a bfloat16 model) and on AVX-512 it decodes long contexts faster than a
bfloat16 pool (scripts/bench_long_context.py --kv bfloat16,int8: 1.24x at 7,680 keys, before
the integer Q.K of AVX-512 VNNI builds), but on the offline mix beside the bfloat16 model that
``dtype = "auto"`` picks on AVX-512 BF16 CPUs (scripts/bench_offline.py with and without
--engine-arg kv_cache_dtype=int8) it takes 2% less CPU time yet no more tokens a second, within
run-to-run noise, and on AVX2 it is not measured. On an AMX Xeon beside bfloat16 activations it
took less CPU time than bfloat16 in every interleaved offline-mix pair and 1.06x its tokens a
second (three quiet pairs), but decoded 8,000 keys only 0.94-1.17x as fast (two quiet runs of
--kv bfloat16,bfloat16-int8 --batch 0): the bfloat16-query path does not yet gain what the
float32 one does (1.30x at 7,680). It stays an explicit choice until it
measures faster there. Which activations each pool sits beside is one rule:
kernels/pool_pairs.py. Anything else is a ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncengine.common.config import ConfigError
from asyncengine.kernels.cpu import cpu_native
from asyncengine.kernels.cpu.attention_native import extend_kernel_features
from asyncengine.kernels.pool_pairs import beside_what, pool_fits
from asyncengine.kernels.quant_formats import F32, QuantizedTensor

KV_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}

_AVX512, _AVX2 = 1, 4  # extend_kernel_features bits


def keeps_quantized_weights(weights: Mapping[str, object]) -> bool:
    """Whether a loaded model holds weights in a stored quantized format (not F32 rows)."""
    return any(isinstance(w, QuantizedTensor) and w.format != F32 for w in weights.values())


def f16_pool_runs_natively() -> bool:
    """Every native kernel that touches the pool has a float16 build reading it through F16C,
    and the extend kernel's build is the AVX2 + FMA one (where a half pool was measured)."""
    if not cpu_native.kv_f16_native():
        return False
    features = extend_kernel_features(torch.float16)
    return bool(features & _AVX2) and not features & _AVX512


def _int8_refusal(device: torch.device, dtype: torch.dtype, backend: str) -> str:
    """Why an int8 pool cannot be honoured here ("" where it can)."""
    if device.type != "cpu":
        return f"on {device.type} no attention kernel reads an int8 pool (CPU only)"
    if not pool_fits(torch.int8, dtype):
        model = str(dtype).removeprefix("torch.")
        return (
            f"an int8 pool is read beside {beside_what(torch.int8)} activations only "
            f"(the model runs in {model})"
        )
    if backend not in ("auto", "torch"):
        return f"attention_backend {backend!r} does not read an int8 pool (use torch or auto)"
    return ""


def pick_kv_dtype(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    quantized: bool,
    deterministic: bool,
    backend: str = "auto",
) -> torch.dtype:
    """The pool's dtype for ``kv_cache_dtype = name`` and a model of ``dtype`` on ``device``
    whose attention runs on ``backend`` (the ``attention_backend`` config key)."""
    on_cpu = device.type == "cpu"
    if name == "auto":
        half = on_cpu and quantized and dtype == torch.float32 and not deterministic
        return torch.float16 if half and f16_pool_runs_natively() else dtype
    if name not in KV_DTYPE_NAMES:
        raise ConfigError(
            f"config key 'kv_cache_dtype' = {name!r}: expected auto or one of "
            f"{', '.join(KV_DTYPE_NAMES)}"
        )
    wanted = KV_DTYPE_NAMES[name]
    if wanted == torch.int8:
        why = _int8_refusal(device, dtype, backend)
        if why:
            raise ConfigError(f"config key 'kv_cache_dtype' = {name!r}: {why}")
        return wanted
    if wanted == dtype:
        return wanted
    model = str(dtype).removeprefix("torch.")
    fits = on_cpu and pool_fits(wanted, dtype)
    if wanted == torch.float16 and fits and not deterministic:
        return wanted
    if wanted == torch.float16 and fits:
        why = "deterministic mode reads the pool in the model's dtype"
    elif wanted == torch.float16 and on_cpu:
        why = (
            f"a float16 pool is read beside {beside_what(torch.float16)} activations only "
            f"(the model runs in {model})"
        )
    elif on_cpu:
        why = (
            f"on cpu the pool is kept in the model's dtype ({model}), or in float16 beside "
            "float32 activations"
        )
    else:
        why = f"on {device.type} the pool is kept in the model's dtype ({model})"
    raise ConfigError(f"config key 'kv_cache_dtype' = {name!r}: {why}")
