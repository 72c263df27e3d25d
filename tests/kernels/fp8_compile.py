"""Compiles the FP8 skinny GEMM kernels with the `FP8_TILES` entries of Hopper (sm_90, the
weight read as float8 and converted in hardware), RDNA3 (gfx1100) and RDNA4 (gfx1201, both
wave32) and the default entry on sm_80 (those three reading bytes and decoding them) on a
machine without a GPU: Triton's frontend, its LLVM passes and the bundled assemblers reject what
the interpreter never sees, and each launch must fit the family's shared memory (LDS).

Run as `python -m tests.kernels.fp8_compile` without TRITON_INTERPRET; prints one line per
variant and exits 1 on the first failure.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget

from kernels.arch import FAMILY_CONFIGS
from kernels.fp8_linear import DOT_ROWS, FP8_TILES, _fp8_skinny_kernel
from kernels.split_reduce import _reduce_kernel
from tests.kernels.sm90 import ast_source

TARGETS = {
    "hopper": GPUTarget("cuda", 90, 32),
    "rdna3": GPUTarget("hip", "gfx1100", 32),
    "rdna4": GPUTarget("hip", "gfx1201", 32),
    "default": GPUTarget("cuda", 80, 32),
}
# shared memory the default entry must fit: the smallest of the CUDA parts it stands for
DEFAULT_LDS = 99 * 1024
# integers a launch at the served shapes (N, K and the row strides multiples of 16) sees
# specialised as multiples of 16: without it the byte-wide weight loads cannot be vectorised
# and the pipeliner leaves them synchronous
ALIGNED_INTS = ("N", "K", "k_per_split", "stride_xm", "stride_om")


def _aligned(name: str) -> bool:
    return name.endswith("ptr") or name in ALIGNED_INTS


def _arg_type(dtype: str, decode_bits: bool, partial: bool):
    def arg_type(name: str) -> str:
        if name == "w_ptr":
            return "*u8" if decode_bits else "*fp8e4nv"
        if name in ("scale_ptr", "part_ptr") or (name == "out_ptr" and partial):
            return "*fp32"
        if name.endswith("_ptr"):
            return f"*{dtype}"
        return "i32"

    return arg_type


def variants(family: str):
    """(kernel, name, arg_type, constexprs, options): the dot tile unsplit with a bias (bf16)
    and split (fp16), the multiply-add tile where the family runs it, the split reduction."""
    tiles = FP8_TILES[family]
    bits = tiles.decode_bits
    s, f = tiles.skinny, tiles.fma

    def skinny(cfg, block_m, partial):
        return dict(
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            USE_DOT=cfg.use_dot,
            DECODE_BITS=bits,
            WRITE_PARTIAL=partial,
            HAS_BIAS=not partial,
        )

    yield (
        _fp8_skinny_kernel,
        "skinny dot bf16",
        _arg_type("bf16", bits, False),
        skinny(s, DOT_ROWS, False),
        (s.num_warps, s.num_stages),
    )
    yield (
        _fp8_skinny_kernel,
        "skinny dot split fp16",
        _arg_type("fp16", bits, True),
        skinny(s, DOT_ROWS, True),
        (s.num_warps, s.num_stages),
    )
    if tiles.fma_rows > 0:
        yield (
            _fp8_skinny_kernel,
            "skinny fma split bf16",
            _arg_type("bf16", bits, True),
            skinny(f, triton.next_power_of_2(tiles.fma_rows), True),
            (f.num_warps, f.num_stages),
        )
    yield (
        _reduce_kernel,
        "reduce bf16",
        _arg_type("bf16", bits, False),
        dict(BLOCK=1024, HAS_SCALE=True, HAS_BIAS=True),
        (4, 1),
    )


def main() -> int:
    for family, target in TARGETS.items():
        lds = DEFAULT_LDS if family == "default" else FAMILY_CONFIGS[family].lds_bytes
        for fn, name, arg_type, consts, (warps, stages) in variants(family):
            options = {"num_warps": warps, "num_stages": stages}
            if target.backend == "hip" and FP8_TILES[family].waves_per_eu:
                options["waves_per_eu"] = FP8_TILES[family].waves_per_eu
            try:
                src = ast_source(fn, consts, arg_type, aligned=_aligned)
                kernel = triton.compile(src, target=target, options=options)
            except Exception as exc:
                print(f"FAIL {family} {name}: {type(exc).__name__}: {exc}")
                return 1
            shared = kernel.metadata.shared
            if shared > lds:
                print(f"FAIL {family} {name}: {shared} bytes of shared memory")
                return 1
            print(f"ok {family} {name} shared {shared} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
