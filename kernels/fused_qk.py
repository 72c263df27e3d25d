"""Per-head q/k RMSNorm (Qwen3), rotary embedding and the paged K/V store in one kernel.

It reads the fused qkv projection output in place (q, k and v are column ranges of one row, no
copies) and writes three things: the normed, rotated q into a new contiguous buffer for
attention, and the normed, rotated k and the raw v into their cache slots. Models without q/k
norm (Llama, Mistral, Qwen2) run the same kernel with the norm compiled out.

Rounding follows the separate modules this replaces (`norms.head_rms_norm` then
`rope_kv.rope_and_write_kv`): the normed value is rounded to the dtype before the weight
multiplies it, the weighted value is rounded again before the rotation, and the rotation runs in
fp32 and is rounded once. Grid: one program per (row, block of heads). A row's heads are cut into
blocks of at most `_MAX_HEADS_PER_PROGRAM`: q blocks, then k blocks, then v blocks, so even a
one-row round keeps several programs busy and every program moves a similar amount of data.
An FP8 cache gets k and v rounded as above, then divided by their head's scale, clamped and cast
(`kernels.kv_fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options, pdl_options
from kernels.kv_fp8 import check_kv_scales, is_fp8, quantize_kv
from kernels.norms import head_rms_norm_ref
from kernels.rope_kv import load_cos_sin, rope_and_write_kv_ref, rotary_pair_dims

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEADS_PER_PROGRAM = 8


@triton.jit
def _norm_rope_heads(
    src_ptr, dst_ptr, w_ptr, scale_ptr, cos, sin, eps, num_heads, stride_dst_head,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
    STORE_FP8: tl.constexpr,
):
    """dst[h] = rope(norm(src[h])) for the first `num_heads` of HEADS heads; src heads are
    HEAD_DIM apart, dst heads `stride_dst_head` apart; cos/sin [HALF_PAD] fp32. STORE_FP8:
    dst is an FP8 cache, which takes the result divided by the head's scale (scale_ptr)."""
    dtype = src_ptr.dtype.element_ty  # the model's: an FP8 cache rounds from it
    offs_h = tl.arange(0, HEADS)
    offs_f = tl.arange(0, HALF_PAD)
    offs_p = 2 * HALF + tl.arange(0, PASS_PAD)  # partial rotary tail; all masked when rot = D
    dim1, dim2 = rotary_pair_dims(offs_f, HALF, IS_NEOX)
    h_mask = offs_h[:, None] < num_heads
    f_mask = offs_f < HALF
    p_mask = offs_p < HEAD_DIM
    mask = h_mask & f_mask[None, :]  # [HEADS, HALF_PAD]
    pmask = h_mask & p_mask[None, :]  # [HEADS, PASS_PAD]
    src = src_ptr + offs_h[:, None] * HEAD_DIM
    x1 = tl.load(src + dim1[None, :], mask=mask, other=0.0).to(tl.float32)  # [HEADS, HALF_PAD]
    x2 = tl.load(src + dim2[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + offs_p[None, :], mask=pmask, other=0.0).to(tl.float32)  # [HEADS, PASS_PAD]
    if QK_NORM:
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)  # [HEADS]
        rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + dim1, mask=f_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + dim2, mask=f_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + offs_p, mask=p_mask, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp[None, :]).to(dtype).to(tl.float32)
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    outp = xp.to(dtype)
    if STORE_FP8:
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)[:, None]
        out1 = quantize_kv(out1.to(tl.float32), scale)
        out2 = quantize_kv(out2.to(tl.float32), scale)
        outp = quantize_kv(outp.to(tl.float32), scale)
    dst_ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + offs_h[:, None] * stride_dst_head
    tl.store(dst + dim1[None, :], out1.to(dst_ty), mask=mask)
    tl.store(dst + dim2[None, :], out2.to(dst_ty), mask=mask)
    tl.store(dst + offs_p[None, :], outp.to(dst_ty), mask=pmask)


@triton.jit
def _copy_heads(
    src_ptr, dst_ptr, scale_ptr, num_heads, stride_dst_head,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, STORE_FP8: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    vals = tl.load(src_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
    if STORE_FP8:
        scale = tl.load(scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)[:, None]
        vals = quantize_kv(vals.to(tl.float32), scale)
    vals = vals.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs_h[:, None] * stride_dst_head + offs_d[None, :], vals, mask=mask)


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    eps, num_q_heads, num_kv_heads, num_q_blocks, num_k_blocks,
    stride_qkv_row, stride_qo_row, stride_qo_head, stride_cs_pos,
    stride_kc_blk, stride_kc_tok, stride_kc_head,
    stride_vc_blk, stride_vc_tok, stride_vc_head,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    HEADS: tl.constexpr, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
    KV_FP8: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if USE_PDL:
        # Everything below depends on the kernels before: qkv is the previous GEMM's output,
        # positions and slots may be derived on the device, and the cache slots written here
        # may still be read by an earlier attention launch. Every program waits, also those
        # that store nothing, so this grid ends only after the one before it.
        tl.extra.cuda.gdc_wait()
        # The grid is a few programs per row, all resident at decode sizes, and its body is
        # short: the attention kernel may launch now and sit in its own wait.
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_ptr + row)
    is_real = slot >= 0
    row_ptr = qkv_ptr + row * stride_qkv_row
    if blk < num_q_blocks + num_k_blocks:
        # A padded row may carry any position: read row 0 and rotate by the identity instead.
        pos = tl.where(is_real, tl.load(pos_ptr + row), 0)
        cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs_pos, HALF, HALF_PAD)  # [HALF_PAD]
        cos = tl.where(is_real, cos, 1.0)
        sin = tl.where(is_real, sin, 0.0)
        if blk < num_q_blocks:
            q_head = blk * HEADS
            _norm_rope_heads(
                row_ptr + q_head * HEAD_DIM,
                q_out_ptr + row * stride_qo_row + q_head * stride_qo_head, q_norm_ptr,
                k_scale_ptr, cos, sin, eps, num_q_heads - q_head, stride_qo_head,
                HEADS, HEAD_DIM, HALF, HALF_PAD, PASS_PAD, IS_NEOX, QK_NORM, False,
            )
        elif is_real:
            k_head = (blk - num_q_blocks) * HEADS
            k_page = slot // PAGE_SIZE
            kc_ptr = k_cache_ptr + k_page * stride_kc_blk + (slot % PAGE_SIZE) * stride_kc_tok
            _norm_rope_heads(
                row_ptr + (num_q_heads + k_head) * HEAD_DIM, kc_ptr + k_head * stride_kc_head,
                k_norm_ptr, k_scale_ptr + k_head, cos, sin, eps, num_kv_heads - k_head,
                stride_kc_head, HEADS, HEAD_DIM, HALF, HALF_PAD, PASS_PAD, IS_NEOX, QK_NORM,
                KV_FP8,
            )
    elif is_real:
        v_head = (blk - num_q_blocks - num_k_blocks) * HEADS
        v_page = slot // PAGE_SIZE
        vc_ptr = v_cache_ptr + v_page * stride_vc_blk + (slot % PAGE_SIZE) * stride_vc_tok
        _copy_heads(
            row_ptr + (num_q_heads + num_kv_heads + v_head) * HEAD_DIM,
            vc_ptr + v_head * stride_vc_head, v_scale_ptr + v_head, num_kv_heads - v_head,
            stride_vc_head, HEADS, HEAD_DIM, D_PAD, KV_FP8,
        )


def _check_args(
    qkv, q_norm, k_norm, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, num_q_heads,
    k_scale=None, v_scale=None,
) -> tuple[int, int, int]:
    """Asserts the layout contract; returns (num_rows, num_kv_heads, head_dim)."""
    assert qkv.dim() == 2 and qkv.stride(1) == 1, "qkv must be [N, width] with unit column stride"
    assert qkv.dtype in _FLOAT_DTYPES, f"dtype {qkv.dtype}"
    num_rows = qkv.shape[0]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv width {qkv.shape[1]} != ({num_q_heads} + 2 * {num_kv_heads}) * {head_dim}"
    )
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache must share a dtype"
    assert k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype), "a cache in qkv's dtype or fp8"
    check_kv_scales(k_cache, k_scale, v_scale)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert (q_norm is None) == (k_norm is None), "q and k norm weights come together"
    for w in (q_norm, k_norm):
        if w is not None:
            assert w.shape == (head_dim,) and w.dtype == qkv.dtype and w.stride(0) == 1
    assert positions.shape == (num_rows,) and positions.dtype == torch.int64
    assert slot_mapping.shape == (num_rows,) and slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and 0 < rot_dim <= head_dim, f"rot_dim {rot_dim}, head_dim {head_dim}"
    return num_rows, num_kv_heads, head_dim


def qk_norm_rope_and_write_kv(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    is_neox: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns q [N, Hq, D] contiguous and stores k, v into the cache.

        qkv          [N, (Hq + 2 Hkv) * D]   q heads | k heads | v heads (rows may be strided)
        q_norm/k_norm[D] or both None
        positions    [N] int64
        cos_sin_cache[max_pos, rot_dim] fp32: cos of the rot_dim/2 frequencies | their sin
        slot_mapping [N] int64   block_id * block_size + offset; < 0: a padded row, whose k/v
                                 are not stored and whose q is normed but not rotated
        k/v_cache    [num_blocks, block_size, Hkv, D] in qkv's dtype, or float8_e4m3fn
        k/v_scale    [Hkv] float32, an FP8 cache's: it stores k / k_scale, v / v_scale (clamped)

    is_neox: rotate dim i with dim i + rot_dim/2 (neox), else 2i with 2i+1 (GPT-J). Dims >=
    rot_dim (partial rotary) are normed and pass through unrotated. Every RoPE scaling type
    (linear, llama3, yarn...) lives in how the cos/sin table was built.
    """
    num_rows, num_kv_heads, head_dim = _check_args(
        qkv, q_norm, k_norm, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        num_q_heads, k_scale, v_scale,
    )
    q = torch.empty((num_rows, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_rows == 0:
        return q
    cfg = arch_config(qkv.device)
    heads = min(_MAX_HEADS_PER_PROGRAM, triton.next_power_of_2(num_kv_heads))
    num_q_blocks = triton.cdiv(num_q_heads, heads)
    num_kv_blocks = triton.cdiv(num_kv_heads, heads)
    rot_dim = cos_sin_cache.shape[1]
    qk_norm = q_norm is not None
    fp8 = is_fp8(k_cache.dtype)
    _qk_norm_rope_kv_kernel[(num_rows, num_q_blocks + 2 * num_kv_blocks)](
        qkv, q_norm if qk_norm else qkv, k_norm if qk_norm else qkv,
        positions, cos_sin_cache, slot_mapping, q, k_cache, v_cache,
        k_scale if fp8 else cos_sin_cache, v_scale if fp8 else cos_sin_cache,
        eps, num_q_heads, num_kv_heads, num_q_blocks, num_kv_blocks,
        qkv.stride(0), q.stride(0), q.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF=rot_dim // 2, HALF_PAD=triton.next_power_of_2(rot_dim // 2),
        PASS_PAD=triton.next_power_of_2(max(1, head_dim - rot_dim)),
        HEADS=heads, IS_NEOX=is_neox, QK_NORM=qk_norm, KV_FP8=fp8,
        num_warps=cfg.row_warps, **launch_options(qkv.device, cfg.waves_per_eu),
        **pdl_options(qkv.device),
    )
    return q


def qk_norm_rope_and_write_kv_ref(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    is_neox: bool,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure torch, any device: the separate head norm and RoPE + KV store references in turn
    (qkv itself is left unchanged)."""
    num_rows, num_kv_heads, head_dim = _check_args(
        qkv, q_norm, k_norm, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        num_q_heads, k_scale, v_scale,
    )
    q, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q = q.reshape(num_rows, num_q_heads, head_dim)  # [N, Hq, D] views into qkv
    k = k.reshape(num_rows, num_kv_heads, head_dim)  # [N, Hkv, D]
    v = v.reshape(num_rows, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = head_rms_norm_ref(q, q_norm, eps), head_rms_norm_ref(k, k_norm, eps)
    else:
        q, k = q.clone(), k.clone()  # rotated in place below
    rope_and_write_kv_ref(
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, is_neox=is_neox,
        k_scale=k_scale, v_scale=v_scale,
    )
    return q.contiguous()
