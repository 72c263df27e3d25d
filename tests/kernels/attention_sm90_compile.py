"""Compiles the Hopper entry's verify-attention launches for sm_90 on a machine without a GPU
(Triton's frontend and LLVM passes, the bundled ptxas and cuobjdump) and checks that the
programs-per-SM figures of the arch table fit the registers and shared memory the compiler
gives each launch. The interpreter never sees either.

Run as `python -m tests.kernels.attention_sm90_compile` without TRITON_INTERPRET; prints one
line per launch and exits 1 on the first failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from kernels import arch
from kernels.attention_kernel import _verify_attention_kernel
from kernels.attention_tiling import next_pow2, plan_launch, programs_per_sm, seqs_pad
from tests.kernels.sm90 import compile_sm90

_NUM_SMS = 132  # H100 SXM / H200
_REGS_PER_SM = 65536
_SHARED_PER_SM = 228 * 1024  # of which each resident block reserves 1 KB
_INT_PTRS = ("cu_q_lens_ptr", "seq_lens_ptr", "block_tables_ptr")

# (batch, ctx, rows, GQA) of the benchmark: tiles of 16, 32, 64 and 128 query vectors without
# a split, the split launches of batch 1 at long context, a split launch of 128-vector tiles
# filling the slots (2 stages), and 16 rows x GQA 8 in a grid too small for 128-vector tiles.
SHAPES = (
    (64, 8192, 1, 4),
    (64, 8192, 8, 4),
    (64, 8192, 8, 8),
    (64, 8192, 16, 8),
    (1, 32768, 1, 4),
    (1, 32768, 8, 8),
    (1, 32768, 16, 8),
    (16, 8192, 16, 8),
    (1, 1024, 16, 8),
)


def _arg_type(name: str) -> str:
    if name.startswith("part_"):
        return "*fp32"
    if name in _INT_PTRS:
        return "*i32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name == "scale_log2" else "i32"


def _aligned(name: str) -> bool:
    # what the launcher specialises for the benchmark's tensors: 16-byte aligned pointers,
    # strides and sizes that are multiples of 16 (the float scale is not specialised)
    return name != "scale_log2"


def _registers(cubin: bytes) -> int:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"REG:(\d+)", report).group(1))


def main() -> int:
    hopper = arch.FAMILY_CONFIGS["hopper"]
    arch._config_for = lambda device_type, index: (hopper, _NUM_SMS)  # plan as on an H200
    device = torch.device("cpu")
    for batch, ctx, rows, gqa in SHAPES:
        num_q_heads, num_kv_heads, head_dim = 8 * gqa, 8, 128
        launch = plan_launch(
            device,
            num_rows=batch * rows,
            num_seqs=batch,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            max_kv_len=ctx,
            max_q_len=rows,
        )
        consts = dict(
            GROUP=gqa, GROUP_PAD=next_pow2(gqa), ROWS_TILE=launch.rows_per_tile,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HEAD_DIM=head_dim, D_PAD=head_dim,
            PAGE_SIZE=16, SPLIT=launch.num_splits > 1, SEQS_PAD=seqs_pad(batch),
            EVEN_D=True, DOT_PRECISION="tf32", LAZY_RESCALE=launch.lazy_rescale,
            PIPELINE_QK=launch.pipeline_qk,
        )  # fmt: skip
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        if launch.max_regs:
            options["maxnreg"] = launch.max_regs
        name = f"b{batch} ctx{ctx} r{rows} gqa{gqa} {launch}"
        kernel = compile_sm90(_verify_attention_kernel, consts, _arg_type, options, name, _aligned)
        if kernel is None:
            return 1
        regs = _registers(kernel.asm["cubin"])
        shared = kernel.metadata.shared
        threads = 32 * launch.num_warps
        fit_regs = _REGS_PER_SM // (-(-regs // 8) * 8 * threads)
        fit_shared = _SHARED_PER_SM // (shared + 1024)
        claimed = programs_per_sm(device, launch.block_m)
        line = f"{name}: {regs} registers, {shared} B shared, {min(fit_regs, fit_shared)} per SM"
        if launch.num_splits == 1 and min(fit_regs, fit_shared) < claimed:
            print(f"FAIL {line}; the arch table counts {claimed}")
            return 1
        print(f"ok {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
