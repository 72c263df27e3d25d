"""Fused rotary embedding of q and k and the store of k, v into their paged cache slots.

One program per token: it rotates every q and k head of that token in place and writes the
rotated k and v to `k_cache/v_cache[slot // block_size, slot % block_size]`, so the new rows'
KV is in the cache before attention reads it, without a second pass over k.

The model's forward uses `kernels.fused_qk` instead, which also applies Qwen3's q/k norm and
reads q, k, v straight from the fused projection output in the same launch (and shares the
rotary helpers of this module); this in-place form serves callers that hold q, k and v as
separate tensors. An FP8 cache stores k and v through `kernels.kv_fp8`'s rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options
from kernels.kv_fp8 import check_kv_scales, is_fp8, kv_store_ref, quantize_kv


@triton.jit
def rotary_pair_dims(offs_f, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """The two dims rotated together by frequency offs_f: (i, i + HALF) in the neox style,
    (2i, 2i + 1) interleaved."""
    if IS_NEOX:
        dim1 = offs_f
        dim2 = offs_f + HALF
    else:
        dim1 = offs_f * 2
        dim2 = offs_f * 2 + 1
    return dim1, dim2


@triton.jit
def load_cos_sin(cos_sin_ptr, pos, stride_cs_pos, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """cos and sin [HALF_PAD] fp32 of position `pos` from its row of the cos | sin table."""
    offs_f = tl.arange(0, HALF_PAD)
    f_mask = offs_f < HALF
    cs_row = cos_sin_ptr + pos * stride_cs_pos
    cos = tl.load(cs_row + offs_f, mask=f_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + offs_f, mask=f_mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_heads(
    x_ptr, cache_ptr, scale_ptr, cos, sin, num_heads,
    stride_x_head, stride_c_head,
    HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, WRITE_CACHE: tl.constexpr, STORE_FP8: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_f = tl.arange(0, HALF_PAD)
    dim1, dim2 = rotary_pair_dims(offs_f, HALF, IS_NEOX)
    mask = (offs_h[:, None] < num_heads) & (offs_f[None, :] < HALF)
    head_off = offs_h[:, None] * stride_x_head
    x1 = tl.load(x_ptr + head_off + dim1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + head_off + dim2[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + head_off + dim1[None, :], out1, mask=mask)
    tl.store(x_ptr + head_off + dim2[None, :], out2, mask=mask)
    if WRITE_CACHE:
        if STORE_FP8:  # the rotated value as the model's dtype holds it, then scaled
            scale = tl.load(scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)[:, None]
            out1 = quantize_kv(out1.to(tl.float32), scale)
            out2 = quantize_kv(out2.to(tl.float32), scale)
        c_off = offs_h[:, None] * stride_c_head
        c_ty = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + c_off + dim1[None, :], out1.to(c_ty), mask=mask)
        tl.store(cache_ptr + c_off + dim2[None, :], out2.to(c_ty), mask=mask)


@triton.jit
def _copy_heads(
    src_ptr, dst_ptr, scale_ptr, num_heads, stride_src_head, stride_dst_head,
    HEADS_PAD: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, SPAN_PAD: tl.constexpr,
    STORE_FP8: tl.constexpr,
):
    """dst[h, LO:HI] = src[h, LO:HI] for every head (divided by the head's scale into FP8)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = LO + tl.arange(0, SPAN_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HI)
    vals = tl.load(src_ptr + offs_h[:, None] * stride_src_head + offs_d[None, :], mask=mask)
    if STORE_FP8:
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)[:, None]
        vals = quantize_kv(vals.to(tl.float32), scale)
    vals = vals.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs_h[:, None] * stride_dst_head + offs_d[None, :], vals, mask=mask)


@triton.jit
def _rope_and_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, num_q_heads, num_kv_heads,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_cs_pos, stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        pos = tl.load(pos_ptr + tok)
        cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs_pos, HALF, HALF_PAD)  # [HALF_PAD]
        page = slot // PAGE_SIZE
        kc_ptr = k_cache_ptr + page * stride_kc_blk + (slot % PAGE_SIZE) * stride_kc_tok
        vc_ptr = v_cache_ptr + page * stride_vc_blk + (slot % PAGE_SIZE) * stride_vc_tok
        _rotate_heads(
            q_ptr + tok * stride_q_row, q_ptr, k_scale_ptr, cos, sin, num_q_heads,
            stride_q_head, 0, QH_PAD, HALF_PAD, HALF, IS_NEOX, False, False,
        )
        _rotate_heads(
            k_ptr + tok * stride_k_row, kc_ptr, k_scale_ptr, cos, sin, num_kv_heads,
            stride_k_head, stride_kc_head, KH_PAD, HALF_PAD, HALF, IS_NEOX, True, KV_FP8,
        )
        if 2 * HALF < HEAD_DIM:  # partial rotary: the tail of k goes to the cache unrotated
            _copy_heads(
                k_ptr + tok * stride_k_row, kc_ptr, k_scale_ptr, num_kv_heads, stride_k_head,
                stride_kc_head, KH_PAD, 2 * HALF, HEAD_DIM, PASS_PAD, KV_FP8,
            )
        _copy_heads(
            v_ptr + tok * stride_v_row, vc_ptr, v_scale_ptr, num_kv_heads, stride_v_head,
            stride_vc_head, KH_PAD, 0, HEAD_DIM, D_PAD, KV_FP8,
        )


def _check_head_tensor(x: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> None:
    assert x.dim() == 3 and x.shape[0] == num_tokens and x.shape[2] == head_dim, (
        f"{name} must be [N, heads, {head_dim}], got {tuple(x.shape)}"
    )
    assert x.stride(2) == 1, f"{name} needs a contiguous last dim"


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    is_neox: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotates q and k in place and stores k, v into the cache.

        q            [N, Hq, D]      rotated in place (rows may be strided: a view into qkv)
        k, v         [N, Hkv, D]     k rotated in place
        positions    [N] int64
        cos_sin_cache[max_pos, rot_dim] fp32: cos of the rot_dim/2 frequencies | their sin
        slot_mapping [N] int64       block_id * block_size + offset; < 0: padding, the token
                                     is left untouched (no rotation, no write)
        k/v_cache    [num_blocks, block_size, Hkv, D] in q's dtype, or float8_e4m3fn
        k/v_scale    [Hkv] float32: an FP8 cache stores k / k_scale and v / v_scale (clamped)

    is_neox: rotate dim i with dim i + rot_dim/2 (neox), else 2i with 2i+1 (GPT-J). Dims >=
    rot_dim (partial rotary) pass through. Every RoPE scaling type (linear, llama3, yarn...)
    lives in how the cache table was built; the rotation itself is the same.
    """
    num_tokens, num_q_heads, head_dim = q.shape  # [N, Hq, D]
    _check_head_tensor(k, "k", num_tokens, head_dim)
    _check_head_tensor(v, "v", num_tokens, head_dim)
    num_kv_heads = k.shape[1]
    assert v.shape[1] == num_kv_heads and q.stride(2) == 1
    assert q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype == q.dtype or is_fp8(k_cache.dtype), f"cache dtype {k_cache.dtype}"
    check_kv_scales(k_cache, k_scale, v_scale)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, f"rot_dim {rot_dim}, head_dim {head_dim}"
    if num_tokens == 0:
        return
    cfg = arch_config(q.device)
    half = rot_dim // 2
    fp8 = is_fp8(k_cache.dtype)
    _rope_and_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        k_scale if fp8 else cos_sin_cache, v_scale if fp8 else cos_sin_cache,
        num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        PASS_PAD=triton.next_power_of_2(max(1, head_dim - rot_dim)),
        QH_PAD=triton.next_power_of_2(num_q_heads), KH_PAD=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox, KV_FP8=fp8,
        num_warps=cfg.row_warps, **launch_options(q.device, cfg.waves_per_eu),
    )


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    """x [n, H, D] rotated in place over its first rot_dim dims; cos/sin [n, rot_dim/2] fp32."""
    half = cos.shape[-1]
    if is_neox:
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
    else:
        x1, x2 = x[..., 0 : 2 * half : 2].float(), x[..., 1 : 2 * half : 2].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    out1 = (x1 * cos - x2 * sin).to(x.dtype)
    out2 = (x2 * cos + x1 * sin).to(x.dtype)
    if is_neox:
        x[..., :half], x[..., half : 2 * half] = out1, out2
    else:
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = out1, out2


def rope_and_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    is_neox: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Pure torch, any device; same in-place effects as the kernel."""
    keep = slot_mapping >= 0  # [N]
    rows = keep.nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions[rows]].float()  # [n, rot_dim]
    cos, sin = cs[:, :half], cs[:, half:]
    q_sel, k_sel = q[rows], k[rows]  # copies: [n, Hq, D], [n, Hkv, D]
    _rotate_ref(q_sel, cos, sin, is_neox)
    _rotate_ref(k_sel, cos, sin, is_neox)
    q[rows], k[rows] = q_sel, k_sel
    slots = slot_mapping[rows]
    page_size = k_cache.shape[1]
    k_cache[slots // page_size, slots % page_size] = kv_store_ref(k_sel, k_scale, k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = kv_store_ref(v[rows], v_scale, v_cache.dtype)
