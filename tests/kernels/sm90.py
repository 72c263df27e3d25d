"""Shared parts of the CPU compile checks for sm_90 (H100/H200): Triton's frontend, its LLVM
passes and the bundled ptxas build a kernel for the GPU without one. The interpreter runs kernels
as Python and never sees what only the compiler rejects (types that differ between the arms of an
`if`, layouts, register limits, shared memory)."""

from __future__ import annotations

from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


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
