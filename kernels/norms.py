"""RMSNorm (optionally fused with the residual add), SiLU-and-mul and Qwen3's per-head q/k norm.

Rounding follows the Hugging Face modules these replace, so the kernels and the torch references
agree to the last bit in most elements: the residual sum is rounded to the activation dtype
before it is normalised, statistics are fp32, the normalised value is rounded to the dtype
before the weight multiplies it, and SiLU's output is rounded before the product with `up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options, pdl_options

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, eps, hidden,
    stride_x, stride_res, stride_out, stride_new_res,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # immutable: before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and the residual come from the kernels before
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
    if USE_PDL:
        # One row per program, all of them resident at once at decode sizes: the next kernel
        # (a linear layer streaming its weights) may launch as soon as the loads are issued.
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], weight [H]. Without residual: norm(x) [N, H]. With residual [N, H]:
    h = x + residual; returns (norm(h) [N, H], h [N, H])."""
    num_rows, hidden = x.shape  # [N, H]
    assert x.dtype in _FLOAT_DTYPES and x.stride(1) == 1
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.stride(0) == 1
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)  # [N, H]
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
        new_res = torch.empty_like(out)  # [N, H]
    else:
        residual, new_res = x, out  # unused by the kernel
    if num_rows > 0:
        cfg = arch_config(x.device)
        _rms_norm_kernel[(num_rows,)](
            x, residual, weight, out, new_res, eps, hidden,
            x.stride(0), residual.stride(0), out.stride(0), new_res.stride(0),
            HAS_RESIDUAL=new_res is not out, BLOCK=triton.next_power_of_2(hidden),
            num_warps=cfg.row_warps, **launch_options(x.device, cfg.waves_per_eu),
            **pdl_options(x.device),
        )
    return (out, new_res) if new_res is not out else out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = ((hf * rstd).to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, h)


@triton.jit
def _head_rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, eps, num_heads, head_dim,
    stride_x_row, stride_x_head, stride_out_row, stride_out_head,
    HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    x_ptrs = x_ptr + row * stride_x_row + offs_h[:, None] * stride_x_head + offs_d[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, D_PAD]
    rstd = tl.rsqrt(tl.sum(x * x, 1) / head_dim + eps)  # [HEADS_PAD]
    w = tl.load(w_ptr + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    o_ptrs = out_ptr + row * stride_out_row + offs_h[:, None] * stride_out_head + offs_d[None, :]
    tl.store(o_ptrs, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 q/k norm: RMSNorm over head_dim of every head. x [N, H, D] (rows may be strided,
    e.g. a view into a fused qkv output), weight [D]; returns a contiguous [N, H, D]."""
    num_rows, num_heads, head_dim = x.shape  # [N, H, D]
    assert x.dtype in _FLOAT_DTYPES and x.stride(2) == 1
    assert weight.shape == (head_dim,) and weight.dtype == x.dtype and weight.stride(0) == 1
    out = torch.empty((num_rows, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_rows > 0:
        cfg = arch_config(x.device)
        _head_rms_norm_kernel[(num_rows,)](
            x, weight, out, eps, num_heads, head_dim,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            HEADS_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
            num_warps=cfg.row_warps, **launch_options(x.device, cfg.waves_per_eu),
        )
    return out


def head_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x.reshape(-1, x.shape[-1]), weight, eps).reshape(x.shape)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # gate | up is the previous kernel's output
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        # A few programs per row, all resident at decode sizes: the down projection may launch
        # (and start streaming its weights) once the loads are issued.
        tl.extra.cuda.gdc_launch_dependents()
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] = gate | up; returns silu(gate) * up [N, I]."""
    num_rows, double_inter = x.shape  # [N, 2I]
    assert double_inter % 2 == 0 and x.dtype in _FLOAT_DTYPES and x.stride(1) == 1
    inter = double_inter // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)  # [N, I]
    if num_rows > 0:
        cfg = arch_config(x.device)
        block = min(4096, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
            num_warps=cfg.row_warps, **launch_options(x.device, cfg.waves_per_eu),
            **pdl_options(x.device),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :inter].float()).to(x.dtype).float()
            * x[..., inter:].float()).to(x.dtype)
