"""Compiles the fused q/k kernel for an H100/H200 (sm_90) on a machine without a GPU: Triton's
frontend, its LLVM passes and the bundled ptxas. The interpreter runs kernels as Python and never
sees what only the compiler rejects (types that differ between the arms of an `if`, layouts,
register limits), so this is the CPU check that every variant the model can launch builds.

Run as `python -m tests.kernels.sm90_compile` without TRITON_INTERPRET (the kernels must be
`JITFunction`s); prints one line per variant and exits 1 on the first failure.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.fused_qk import _qk_norm_rope_kv_kernel

_TARGET = GPUTarget("cuda", 90, 32)
_NUM_WARPS = 8  # the Hopper entry's row_warps


def _source(dtype: str, consts: dict) -> ASTSource:
    fn = _qk_norm_rope_kv_kernel
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("pos_ptr", "slot_ptr"):
            signature[name] = "*i64"
        elif name == "cos_sin_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name == "eps":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def variants():
    """(dtype, constants): both rotation styles with and without q/k norm at head_dim 128,
    partial rotary, one head per program (MQA) and head_dim 64."""
    for dtype in ("bf16", "fp16"):
        for is_neox in (True, False):
            for qk_norm in (True, False):
                yield dtype, dict(HALF=64, HALF_PAD=64, PASS_PAD=1, HEADS=8,
                                  IS_NEOX=is_neox, QK_NORM=qk_norm)  # fmt: skip
    yield "bf16", dict(HALF=32, HALF_PAD=32, PASS_PAD=64, HEADS=8, IS_NEOX=True, QK_NORM=True)
    yield "bf16", dict(HALF=64, HALF_PAD=64, PASS_PAD=1, HEADS=1, IS_NEOX=True, QK_NORM=True)
    yield "bf16", dict(HALF=32, HALF_PAD=32, PASS_PAD=1, HEADS=4, IS_NEOX=True, QK_NORM=False,
                       HEAD_DIM=64, D_PAD=64)  # fmt: skip


def main() -> int:
    for dtype, consts in variants():
        consts = {"PAGE_SIZE": 16, "HEAD_DIM": 128, "D_PAD": 128, **consts}
        try:
            kernel = triton.compile(
                _source(dtype, consts), target=_TARGET, options={"num_warps": _NUM_WARPS}
            )
        except Exception as exc:
            print(f"FAIL {dtype} {consts}: {type(exc).__name__}: {exc}")
            return 1
        print(f"ok {dtype} {consts} cubin {len(kernel.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
