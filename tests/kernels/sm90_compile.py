"""Compiles the fused q/k kernel for an H100/H200 (sm_90) on a machine without a GPU
(`tests/kernels/sm90.py`): the CPU check that every variant the model can launch builds.

Run as `python -m tests.kernels.sm90_compile` without TRITON_INTERPRET (the kernels must be
`JITFunction`s); prints one line per variant and exits 1 on the first failure.
"""

from __future__ import annotations

import sys

from kernels.fused_qk import _qk_norm_rope_kv_kernel
from tests.kernels.sm90 import compile_sm90

_NUM_WARPS = 8  # the Hopper entry's row_warps


def _arg_type(dtype: str):
    def arg_type(name: str) -> str:
        if name in ("pos_ptr", "slot_ptr"):
            return "*i64"
        if name == "cos_sin_ptr":
            return "*fp32"
        if name.endswith("_ptr"):
            return f"*{dtype}"
        return "fp32" if name == "eps" else "i32"

    return arg_type


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
        options = {"num_warps": _NUM_WARPS}
        name = f"{dtype} {consts}"
        kernel = compile_sm90(_qk_norm_rope_kv_kernel, consts, _arg_type(dtype), options, name)
        if kernel is None:
            return 1
        print(f"ok {dtype} {consts} cubin {len(kernel.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
