"""The second kernel of a split-K skinny GEMM: sums the fp32 partial products of the splits in
split order (the same result on every run), scales each output column, adds the bias and casts
to the output's dtype, in one launch. The weight-only quantized kernels (kernels/fp8_linear.py,
kernels/int4_linear.py) share it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

REDUCE_BLOCK = 1024  # outputs per program


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, out_ptr, num_rows, N, num_splits, stride_om,
    BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):  # split order: the same sum on every run
        total += tl.load(part_ptr + (s * num_rows + row) * N + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        total *= tl.load(scale_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_splits(
    part: torch.Tensor,  # [splits, M, N] fp32
    out: torch.Tensor,  # [M, N], the last dimension contiguous
    scale: torch.Tensor | None,  # [N] fp32: a multiplier per output column
    bias: torch.Tensor | None,  # [N]
    options: dict,
) -> torch.Tensor:
    num_splits, num_rows, n = part.shape
    dummy = part  # an unread pointer where an operand is absent
    _reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), num_rows)](
        part, scale if scale is not None else dummy, bias if bias is not None else dummy, out,
        num_rows, n, num_splits, out.stride(0),
        BLOCK=REDUCE_BLOCK, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        num_warps=4, **options,
    )  # fmt: skip
    return out
