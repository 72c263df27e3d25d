"""Compiles the int4 GEMM kernels with the `INT4_TILES` entries of Hopper (sm_90), RDNA3
(gfx1100) and RDNA4 (gfx1201, both wave32) on a machine without a GPU: Triton's frontend, its
LLVM passes and the bundled assemblers reject what the interpreter never sees, and each
launch must fit the family's shared memory (LDS).

Run as `python -m tests.kernels.int4_compile` without TRITON_INTERPRET; prints one line per
variant and exits 1 on the first failure.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget

from kernels.arch import FAMILY_CONFIGS
from kernels.int4_linear import INT4_TILES, _int4_skinny_kernel, _int4_tiled_kernel
from tests.kernels.sm90 import ast_source

TARGETS = {
    "hopper": GPUTarget("cuda", 90, 32),
    "rdna3": GPUTarget("hip", "gfx1100", 32),
    "rdna4": GPUTarget("hip", "gfx1201", 32),
}


def _arg_type(dtype: str):
    def arg_type(name: str) -> str:
        if name in ("qw_ptr", "g_ptr"):
            return "*i32"
        if name == "z_ptr":
            return "*u8"
        if name == "out_ptr":
            return f"*{dtype}"
        if name.endswith("_ptr"):
            return f"*{dtype}"
        return "i32"

    return arg_type


def variants(family: str):
    """(kernel, name, dtype, constexprs, options): the skinny kernel's dot and multiply-add
    paths, the tiled kernel, each with contiguous groups (one scale row per tile) and with
    act-order indices."""
    tiles = INT4_TILES[family]
    s, t = tiles.skinny, tiles.tiled
    yield (
        _int4_skinny_kernel,
        "skinny dot",
        "bf16",
        dict(
            BLOCK_M=16,
            BLOCK_N=s.block_n,
            BLOCK_K=s.block_k,
            USE_DOT=True,
            HAS_GIDX=False,
            SCALE_ROW=True,
            WRITE_PARTIAL=False,
            HAS_BIAS=True,
        ),
        (s.num_warps, s.num_stages),
    )
    yield (
        _int4_skinny_kernel,
        "skinny fma gidx",
        "fp16",
        dict(
            BLOCK_M=2,
            BLOCK_N=s.block_n,
            BLOCK_K=s.block_k,
            USE_DOT=False,
            HAS_GIDX=True,
            SCALE_ROW=False,
            WRITE_PARTIAL=True,
            HAS_BIAS=False,
        ),
        (s.num_warps, 1),
    )
    yield (
        _int4_tiled_kernel,
        "tiled",
        "bf16",
        dict(
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            GROUP_M=t.group_m,
            HAS_GIDX=False,
            SCALE_ROW=True,
            HAS_BIAS=False,
        ),
        (t.num_warps, t.num_stages),
    )
    yield (
        _int4_tiled_kernel,
        "tiled gidx",
        "fp16",
        dict(
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            GROUP_M=t.group_m,
            HAS_GIDX=True,
            SCALE_ROW=False,
            HAS_BIAS=True,
        ),
        (t.num_warps, t.num_stages),
    )


def main() -> int:
    for family, target in TARGETS.items():
        for fn, name, dtype, consts, (warps, stages) in variants(family):
            options = {"num_warps": warps, "num_stages": stages}
            if target.backend == "hip" and INT4_TILES[family].waves_per_eu:
                options["waves_per_eu"] = INT4_TILES[family].waves_per_eu
            try:
                src = ast_source(fn, consts, _arg_type(dtype), aligned=lambda n: n.endswith("ptr"))
                kernel = triton.compile(src, target=target, options=options)
            except Exception as exc:
                print(f"FAIL {family} {name} {dtype}: {type(exc).__name__}: {exc}")
                return 1
            shared = kernel.metadata.shared
            if shared > FAMILY_CONFIGS[family].lds_bytes:
                print(f"FAIL {family} {name} {dtype}: {shared} bytes of shared memory")
                return 1
            print(f"ok {family} {name} {dtype} shared {shared} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
