"""Compiles the FP8 KV cache variants of the K/V writers and of verify attention for an
H100/H200 (sm_90) on a machine without a GPU (`tests/kernels/sm90.py`): bf16 queries and rows,
float8_e4m3fn caches, float32 per-head scales, in the launches the Qwen3-8B shapes make.

Run as `python -m tests.kernels.kv_fp8_sm90_compile` without TRITON_INTERPRET; prints one line
per variant and exits 1 on the first failure.
"""

from __future__ import annotations

import sys

import torch

from kernels import arch
from kernels.attention_kernel import _verify_attention_kernel
from kernels.attention_tiling import plan_launch, seqs_pad
from kernels.fused_qk import _qk_norm_rope_kv_kernel
from kernels.rope_kv import _rope_and_write_kv_kernel
from tests.kernels.sm90 import bf16_arg_types, compile_sm90

_CACHE_PTRS = ("k_cache_ptr", "v_cache_ptr")
_FP32_PTRS = ("k_scale_ptr", "v_scale_ptr", "cos_sin_ptr", "part_out_ptr", "part_lse_ptr")
_INT_PTRS = ("cu_q_lens_ptr", "seq_lens_ptr", "block_tables_ptr")


def variants():
    """(name, kernel, constexprs, argument types, options)."""
    writer_types = bf16_arg_types(_FP32_PTRS, _INT_PTRS, fp8_ptrs=_CACHE_PTRS)
    yield ("qk_norm_rope_kv", _qk_norm_rope_kv_kernel,
           dict(PAGE_SIZE=16, HEAD_DIM=128, D_PAD=128, HALF=64, HALF_PAD=64, PASS_PAD=1,
                HEADS=8, IS_NEOX=True, QK_NORM=True, KV_FP8=True),
           writer_types, {"num_warps": 8})  # fmt: skip
    # partial rotary: the unrotated tail of k is scaled and stored too
    yield ("rope_and_write_kv partial rotary", _rope_and_write_kv_kernel,
           dict(PAGE_SIZE=16, HEAD_DIM=128, D_PAD=128, HALF=32, HALF_PAD=32, PASS_PAD=64,
                QH_PAD=32, KH_PAD=8, IS_NEOX=True, KV_FP8=True),
           writer_types, {"num_warps": 8})  # fmt: skip
    attn_types = bf16_arg_types(_FP32_PTRS, _INT_PTRS, fp8_ptrs=("k_ptr", "v_ptr"))
    hopper = arch.FAMILY_CONFIGS["hopper"]
    arch._config_for = lambda device_type, index: (hopper, 132)  # plan as on an H200
    # a split decode launch, and speculative groups of 16 rows with q.k issued a tile ahead
    for batch, rows, ctx, pipeline in ((1, 1, 8192, False), (64, 16, 2048, True)):
        launch = plan_launch(
            torch.device("cpu"), num_rows=batch * rows, num_seqs=batch, num_q_heads=32,
            num_kv_heads=8, max_kv_len=ctx, max_q_len=rows,
        )  # fmt: skip
        consts = dict(
            GROUP=4, GROUP_PAD=4, ROWS_TILE=launch.rows_per_tile, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, HEAD_DIM=128, D_PAD=128, PAGE_SIZE=16,
            SPLIT=launch.num_splits > 1, SEQS_PAD=seqs_pad(batch), EVEN_D=True,
            DOT_PRECISION="tf32", LAZY_RESCALE=False, PIPELINE_QK=pipeline, KV_FP8=True,
        )  # fmt: skip
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        if launch.max_regs:
            options["maxnreg"] = launch.max_regs
        name = f"verify_attention b{batch} r{rows} splits={launch.num_splits} pipeline={pipeline}"
        yield name, _verify_attention_kernel, consts, attn_types, options


def main() -> int:
    for name, kernel, consts, arg_type, options in variants():
        compiled = compile_sm90(kernel, consts, arg_type, options, name)
        if compiled is None:
            return 1
        ptx = compiled.asm["ptx"]
        if "e4m3" not in ptx:  # the float8 conversions are the hardware's
            print(f"FAIL {name}: no e4m3 conversion in the PTX")
            return 1
        print(f"ok {name}: cubin {len(compiled.asm['cubin'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
