"""Triton kernels of verify attention: a program per (tile of rows x GQA group, KV head, split).

A tile holds rows of one sequence times the q heads that share one KV head, so a decode step or a
speculative verify reads each KV tile once for all of them and feeds a real matrix product.
Query vector m of a tile is (row m // GROUP_PAD, head m % GROUP_PAD); prefill chunks span tiles.
Tiles of sequence s are numbered from `cu_q_lens[s] // ROWS_TILE + s`, which bounds the grid by
shapes alone (graph capture is safe): a program finds its sequence by counting tile starts <= its
id and exits past the sequence's rows; tiles past the last sequence zero the padding rows, so
every element of `out` is written. Split-KV (axis 2) cuts a tile's KV range into pieces that each
store a normalised partial output and its log2-sum-exp; `_merge_splits_kernel` combines them.
Inner loop: key tiles every row of the tile may see run unmasked; only the tiles holding the
diagonal or the ragged end are masked. The softmax scale is folded into the exp2's FMA. Two
arch-table switches change the schedule, never the result: lazy rescaling (`_softmax_update`)
and q.k issued one KV tile ahead of the softmax and PV of the current tile (PIPELINE_QK).
An FP8 cache (KV_FP8) is read into q's dtype, which holds every e4m3 value exactly; the KV
head's K scale joins the softmax scale and its V scale multiplies the output, so the product
equals attention over `stored * scale` without a multiply per loaded element.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_kv_tile(
    base_ptr, bt_row_ptr, start, kv_hi, stride_blk, stride_tok, offs_d, d_mask,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):
    """K or V of KV positions start..start+BLOCK_N-1 of one head: [BLOCK_N, D_PAD]."""
    offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] KV positions
    if MASKED:
        n_valid = offs_n < kv_hi
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
    tok = offs_n % PAGE_SIZE
    ptrs = base_ptr + page[:, None] * stride_blk + tok[:, None] * stride_tok + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)  # full tile, full head: no predicate, widest loads
    else:
        return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _tile_scores(
    q, k, start, kv_hi, q_pos,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Unscaled q.k of a tile [BLOCK_M, BLOCK_N]; keys a query may not see are -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < kv_hi)[None, :]
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _softmax_update(
    s, v, acc, m_i, l_i, scale_log2,
    LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over one tile of scores s; m_i is in log2 units of the scaled scores.

    The scale goes into the exponent's FMA (s * scale_log2 - m) instead of a pass over s.
    LAZY_RESCALE keeps the running max while no row's max grew by more than 8 (log2 units:
    probabilities then stay <= 2**8, far inside fp32 and bf16 range), so most tiles skip the
    exp2 of alpha and the pass over the accumulator; l_i and acc always refer to the same m_i,
    so the result is unchanged.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # [BLOCK_M]
    if LAZY_RESCALE:
        # Rows without a visible key stay at -inf; a row seeing its first key grows by +inf.
        grow = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0)
        if grow > 8.0:
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(s * scale_log2 - m_ref[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i + tl.sum(p, 1)
    else:
        # A query vector that sees no key yet keeps m = -inf; shifting by 0 keeps exp2 at 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * scale_log2 - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(
    q, q_pos, acc, m_i, l_i, k_base, v_base, bt_row_ptr, start, kv_hi, scale_log2,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, offs_d, d_mask,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One KV tile in order: load K and V, score, online-softmax update."""
    k = _load_kv_tile(
        k_base, bt_row_ptr, start, kv_hi, stride_k_blk, stride_k_tok, offs_d, d_mask,
        BLOCK_N, PAGE_SIZE, MASKED, EVEN_D,
    ).to(q.dtype)
    v = _load_kv_tile(
        v_base, bt_row_ptr, start, kv_hi, stride_v_blk, stride_v_tok, offs_d, d_mask,
        BLOCK_N, PAGE_SIZE, MASKED, EVEN_D,
    ).to(q.dtype)
    s = _tile_scores(q, k, start, kv_hi, q_pos, BLOCK_N, MASKED, DOT_PRECISION)
    return _softmax_update(s, v, acc, m_i, l_i, scale_log2, LAZY_RESCALE, DOT_PRECISION)


# Launch-varying integers are not specialised (Triton would compile separate variants for the
# value 1 and for multiples of 16), and the sequence-search width SEQS_PAD has a floor
# (`attention_tiling.seqs_pad`): a serving round's sequence count must not compile a new kernel
# (seconds) as the batch changes. That includes the block table's row stride (its width: an
# eager round's table is as wide as its longest sequence) and the split buffers' outer strides
# (they scale with the row count).
@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_rows",
        "num_splits",
        "stride_bt_seq",
        "stride_p_split",
        "stride_l_split",
    ]
)
def _verify_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    cu_q_lens_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, num_rows, num_splits, scale_log2,
    stride_q_row, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_row, stride_o_head,
    stride_bt_seq,
    stride_p_split, stride_p_row, stride_p_head,
    stride_l_split, stride_l_row,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, SEQS_PAD: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    PIPELINE_QK: tl.constexpr, CAUSAL: tl.constexpr = True, KV_FP8: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        # q, the lengths and the block table, and the KV just stored come from the kernels
        # before; every program waits (padding ones too), so this grid ends after that one.
        tl.extra.cuda.gdc_wait()

    # Which sequence owns this tile: count tile starts <= tile_id (sentinel s = num_seqs: padding).
    offs_s = tl.arange(0, SEQS_PAD)
    cu = tl.load(cu_q_lens_ptr + offs_s, mask=offs_s <= num_seqs, other=0)
    tile_start = cu // ROWS_TILE + offs_s
    is_before = (tile_start <= tile_id) & (offs_s <= num_seqs)
    seq = tl.sum(is_before.to(tl.int32), 0) - 1
    q_start = tl.load(cu_q_lens_ptr + seq)
    first_tile = q_start // ROWS_TILE + seq
    local_tile = tile_id - first_tile

    offs_m = tl.arange(0, BLOCK_M)
    m_row = offs_m // GROUP_PAD  # [BLOCK_M] row inside the tile
    m_head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] q head
    head_ok = (offs_m % GROUP_PAD < GROUP) & (m_row < ROWS_TILE)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM

    if seq == num_seqs:
        # Rows after the last sequence (graph padding): written as zeros, once (split 0).
        if split == 0:
            pad_row = q_start + local_tile * ROWS_TILE + m_row  # [BLOCK_M]
            pad_ok = head_ok & (pad_row < num_rows)
            o_ptrs = out_ptr + pad_row[:, None].to(tl.int64) * stride_o_row
            o_ptrs += m_head[:, None] * stride_o_head + offs_d[None, :]
            zeros = tl.zeros([BLOCK_M, D_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(o_ptrs, zeros, mask=pad_ok[:, None] & d_mask[None, :])
    else:
        q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
        row0 = local_tile * ROWS_TILE
        if row0 < q_len:
            ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # KV tokens before the first new row
            m_ok = head_ok & (row0 + m_row < q_len)
            q_row = (q_start + row0 + m_row).to(tl.int64)  # [BLOCK_M]
            q_ptrs = q_ptr + q_row[:, None] * stride_q_row + m_head[:, None] * stride_q_head
            q = tl.load(q_ptrs + offs_d[None, :], mask=m_ok[:, None] & d_mask[None, :], other=0.0)
            if CAUSAL:
                q_pos = ctx_len + row0 + m_row  # [BLOCK_M] position of each query vector
                kv_end = ctx_len + tl.minimum(row0 + ROWS_TILE, q_len)  # last row's position + 1
            else:
                # Every row sees the sequence's whole KV, its own rows included: as if it sat
                # at the last row's position (a block drafter's block attends this way).
                q_pos = tl.zeros_like(m_row) + (ctx_len + q_len - 1)  # [BLOCK_M]
                kv_end = ctx_len + q_len
            if not SPLIT:
                kv_lo = 0
                kv_hi = kv_end
            else:
                split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
                kv_lo = tl.minimum(split * split_len, kv_end)
                kv_hi = tl.minimum(kv_lo + split_len, kv_end)
            # Keys before the tile's first row are visible to every row: no mask needed there.
            if CAUSAL:
                full_hi = tl.minimum(kv_hi, ctx_len + row0 + 1)
            else:
                full_hi = kv_hi
            num_full = tl.maximum(full_hi - kv_lo, 0) // BLOCK_N
            masked_lo = kv_lo + num_full * BLOCK_N

            acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
            k_base = k_ptr + kv_head.to(tl.int64) * stride_k_head
            v_base = v_ptr + kv_head.to(tl.int64) * stride_v_head
            if KV_FP8:
                qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
            else:
                qk_scale = scale_log2
            if PIPELINE_QK:
                # q.k of tile n+1 is issued before the softmax and PV of tile n, so the tensor
                # cores work on the next scores while the exp2s of this tile run.
                if num_full > 0:
                    k = _load_kv_tile(
                        k_base, bt_row_ptr, kv_lo, kv_hi, stride_k_blk, stride_k_tok, offs_d,
                        d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    ).to(q.dtype)
                    s = _tile_scores(q, k, kv_lo, kv_hi, q_pos, BLOCK_N, False, DOT_PRECISION)
                    for start in range(kv_lo + BLOCK_N, masked_lo, BLOCK_N):
                        k = _load_kv_tile(
                            k_base, bt_row_ptr, start, kv_hi, stride_k_blk, stride_k_tok,
                            offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                        ).to(q.dtype)
                        s_next = _tile_scores(
                            q, k, start, kv_hi, q_pos, BLOCK_N, False, DOT_PRECISION
                        )
                        v = _load_kv_tile(
                            v_base, bt_row_ptr, start - BLOCK_N, kv_hi, stride_v_blk,
                            stride_v_tok, offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                        ).to(q.dtype)
                        acc, m_i, l_i = _softmax_update(
                            s, v, acc, m_i, l_i, qk_scale, LAZY_RESCALE, DOT_PRECISION
                        )
                        s = s_next
                    v = _load_kv_tile(
                        v_base, bt_row_ptr, masked_lo - BLOCK_N, kv_hi, stride_v_blk,
                        stride_v_tok, offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    ).to(q.dtype)
                    acc, m_i, l_i = _softmax_update(
                        s, v, acc, m_i, l_i, qk_scale, LAZY_RESCALE, DOT_PRECISION
                    )
            else:
                for start in range(kv_lo, masked_lo, BLOCK_N):
                    acc, m_i, l_i = _attend_tile(
                        q, q_pos, acc, m_i, l_i, k_base, v_base, bt_row_ptr, start, kv_hi,
                        qk_scale, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                        offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D, LAZY_RESCALE,
                        DOT_PRECISION,
                    )
            # The tiles holding the diagonal (and the ragged end): the only masked ones.
            for start in range(masked_lo, kv_hi, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    q, q_pos, acc, m_i, l_i, k_base, v_base, bt_row_ptr, start, kv_hi,
                    qk_scale, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, offs_d,
                    d_mask, BLOCK_N, PAGE_SIZE, True, EVEN_D, LAZY_RESCALE, DOT_PRECISION,
                )

            if USE_PDL:
                # After the last KV load: the next kernel (the o projection streaming its
                # weights, or the merge) launches only once every program of this grid got
                # here or exited, so it takes no SM slot from a tile still to be scheduled.
                tl.extra.cuda.gdc_launch_dependents()
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            result = acc / l_safe[:, None]  # [BLOCK_M, D_PAD]
            if KV_FP8:
                result = result * tl.load(v_scale_ptr + kv_head)
            st_mask = m_ok[:, None] & d_mask[None, :]
            if not SPLIT:
                o_ptrs = out_ptr + q_row[:, None] * stride_o_row + m_head[:, None] * stride_o_head
                tl.store(o_ptrs + offs_d[None, :], result.to(out_ptr.dtype.element_ty), st_mask)
            else:
                lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_M]
                split64 = split.to(tl.int64)  # splits x rows x heads x dim can pass 2**31
                p_ptrs = part_out_ptr + split64 * stride_p_split + q_row[:, None] * stride_p_row
                p_ptrs += m_head[:, None] * stride_p_head + offs_d[None, :]
                tl.store(p_ptrs, result, st_mask)
                l_ptrs = part_lse_ptr + split64 * stride_l_split + q_row * stride_l_row + m_head
                tl.store(l_ptrs, lse, m_ok)


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_p_split", "stride_l_split"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_q_lens_ptr, num_seqs, num_splits,
    stride_p_split, stride_p_row, stride_p_head,
    stride_l_split, stride_l_row,
    stride_o_row, stride_o_head,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the partials are the attention kernel's output
    if row < tl.load(cu_q_lens_ptr + num_seqs):  # rows after the last sequence are zeroed already
        offs_s = tl.arange(0, SPLITS_PAD)
        s_mask = offs_s < num_splits
        offs_s = offs_s.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < HEAD_DIM
        row64 = row.to(tl.int64)
        lse = tl.load(
            part_lse_ptr + offs_s * stride_l_split + row64 * stride_l_row + head,
            mask=s_mask, other=float("-inf"),
        )  # [SPLITS_PAD]
        lse_max = tl.max(lse, 0)
        lse_shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        weight = tl.exp2(lse - lse_shift)  # [SPLITS_PAD], 0 for empty splits
        part = tl.load(
            part_out_ptr + offs_s[:, None] * stride_p_split + row64 * stride_p_row
            + head * stride_p_head + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :], other=0.0,
        )  # [SPLITS_PAD, D_PAD]
        if USE_PDL:
            # One program per (row, head), all resident at decode sizes: the o projection may
            # launch once the partials are loaded.
            tl.extra.cuda.gdc_launch_dependents()
        total = tl.sum(weight, 0)
        merged = tl.sum(part * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        o_ptrs = out_ptr + row64 * stride_o_row + head * stride_o_head + offs_d
        tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_mask)
