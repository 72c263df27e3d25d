"""Shared parts of the CPU compile checks for sm_90 (H100/H200): Triton's frontend, its LLVM
passes and the bundled ptxas build a kernel for the GPU without one. The interpreter runs kernels
as Python and never sees what only the compiler rejects (types that differ between the arms of an
`if`, layouts, register limits, shared memory)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
REPO_ROOT = Path(__file__).resolve().parents[2]


def triton_backends() -> set[str]:
    """The code generators this Triton build has ('nvidia', 'amd'): a compile check needs its
    target's."""
    try:
        from triton.backends import backends
    except ImportError:
        return set()
    return set(backends)


def bf16_arg_types(fp32_ptrs=(), int_ptrs=(), fp8_ptrs=()) -> Callable[[str], str]:
    """Triton argument types of a bf16 decode kernel by argument name: the named pointers fp8
    (e4m3), fp32 or int32, positions and slots int64, other pointers bf16; eps and the log2
    softmax scale fp32, other scalars int32."""

    def arg_type(name: str) -> str:
        if name in fp8_ptrs:
            return "*fp8e4nv"
        if name in fp32_ptrs:
            return "*fp32"
        if name in int_ptrs:
            return "*i32"
        if name in ("pos_ptr", "slot_ptr"):
            return "*i64"
        if name.endswith("_ptr"):
            return "*bf16"
        return "fp32" if name in ("eps", "scale_log2") else "i32"

    return arg_type


def run_compile_check(module: str) -> str:
    """Runs a compile-check module in a fresh interpreter (no TRITON_INTERPRET); its stdout.
    Fails the calling test with the module's output tail when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default; silences the 3.9 notice
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def ast_source(
    fn,
    consts: dict,
    arg_type: Callable[[str], str],
    aligned: Callable[[str], bool] = lambda name: False,
) -> ASTSource:
    """The kernel `fn` with `consts` as its constexprs (defaults for those not given), every
    other argument typed by `arg_type(name)` ("*bf16", "i32", ...); `aligned(name)` arguments
    are specialised as the launcher does for 16-byte aligned pointers and multiples of 16."""
    signature, attrs = {}, {}
    # constexprs with a default (USE_PDL) take it unless given, as a launch would
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts = {**defaults, **consts}
    for index, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = arg_type(name)
        if aligned(name):
            attrs[(index,)] = [["tt.divisibility", 16]]
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_sm90(
    fn,
    consts: dict,
    arg_type: Callable[[str], str],
    options: dict,
    name: str,
    aligned: Callable[[str], bool] = lambda name: False,
):
    """The compiled kernel for sm_90, or None after printing `FAIL <name>: <why>`."""
    try:
        return triton.compile(
            ast_source(fn, consts, arg_type, aligned), target=TARGET, options=options
        )
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        return None
