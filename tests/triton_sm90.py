"""Compiling a Triton kernel for an H100 (sm_90) without a GPU, with Triton's own compiler and
the ptxas its wheel ships: for the compile tests' child scripts (tests/python_subprocess.py),
which run without the interpreter."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

# pointer arguments' types by name (any other pointer: bfloat16)
POINTERS = {
    "mid_out_ptr": "*fp32",
    "mid_lse_ptr": "*fp32",
    "block_table_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "slot_mapping_ptr": "*i64",
    "positions_ptr": "*i64",
    "cache_ptr": "*fp32",
}
FLOATS = {"scale_log2", "softcap_log2", "eps"}  # scalar arguments of float32 (others: int32)


def compile_for_sm90(
    kernel: Any,
    constants: dict[str, Any],
    num_warps: int = 4,
    num_stages: int = 2,
    pointers: dict[str, str] | None = None,
) -> None:
    """Compile ``kernel`` (a JIT function or its autotuner) with ``constants`` for sm_90,
    ``pointers`` overriding POINTERS; prints "compiled <name>"."""
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    types = {**POINTERS, **(pointers or {})}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    assert compiled.asm["ptx"], fn.__name__
    print("compiled", fn.__name__)
