"""Verify attention: ragged query rows over a paged KV cache, KV read once per tile of rows.

Layouts (one layer):
    q           [num_rows, num_q_heads, head_dim]    new rows of all sequences, back to back
    k/v_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    cu_q_lens   [num_seqs + 1] int32                 rows of sequence s: cu_q_lens[s]..[s+1]-1
    seq_lens    [num_seqs] int32                     KV length incl. the new rows (already cached)
    block_tables[num_seqs, max_blocks] int32         cache block of each block_size-token page
Row j of sequence s sits at position seq_lens[s] - q_len_s + j and attends to positions <= its own.

Why a tile holds rows x GQA group: a decode step (1 row) or a speculative verify (depth rows) of
one sequence shares the whole KV prefix. A program that holds all of a sequence's rows, times the
q heads sharing one KV head, reads each KV tile once and feeds a real matrix product, instead of
one program per row re-reading the same KV `depth` times. Prefill chunks are cut into tiles of
`rows_per_tile` rows. Query vector m of a tile is (row m // group_pad, head m % group_pad).

Grid (fixed by shapes, so graph capture is safe): axis 0 = tiles. Tiles of sequence s are
numbered from `cu_q_lens[s] // rows_per_tile + s`, which bounds the total by
`cdiv(num_rows, rows_per_tile) + num_seqs` without reading lengths on the host; a program finds
its sequence by counting tile starts <= its id, and exits when its tile is past the sequence.
Tile ids past the last sequence zero the rows after `cu_q_lens[-1]` (graph padding), so every
element of `out` is written. Axis 1 = KV heads, axis 2 = KV splits.

Split-KV: when few tiles would leave SMs idle (batch 1, long context), axis 2 cuts each tile's
KV range into `num_splits` pieces; each writes its normalised partial output and log2-sum-exp,
and `_merge_splits_kernel` combines them (online-softmax merge). The split count fills at most
one wave of program slots (SMs x programs per SM, from the arch table).

Inner loop: tiles of keys every row of the tile may see run without masks; only the tiles
holding the diagonal or the ragged end are masked. The softmax scale is folded into the exp2's
FMA. Two switches of the arch table change the schedule, never the result: lazy rescaling (the
accumulator is rescaled only when some row's max grew by more than 8 in log2 units) and q.k
issued one KV tile ahead of the softmax and PV of the current tile.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options, num_compute_units, pdl_options


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


# Launch-varying integers are not specialised (Triton would compile separate variants for the
# value 1 and for multiples of 16), and the sequence-search width has a floor: a serving round's
# sequence count must not compile a new kernel (seconds) as the batch changes. That includes the
# block table's row stride (its width: an eager round's table is as wide as its longest
# sequence) and the split buffers' outer strides (they scale with the row count).
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
    cu_q_lens_ptr, seq_lens_ptr, block_tables_ptr,
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
    PIPELINE_QK: tl.constexpr, USE_PDL: tl.constexpr = False,
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
            q_pos = ctx_len + row0 + m_row  # [BLOCK_M] position of each query vector

            kv_end = ctx_len + tl.minimum(row0 + ROWS_TILE, q_len)  # last row's position + 1
            if not SPLIT:
                kv_lo = 0
                kv_hi = kv_end
            else:
                split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
                kv_lo = tl.minimum(split * split_len, kv_end)
                kv_hi = tl.minimum(kv_lo + split_len, kv_end)
            # Keys before the tile's first row are visible to every row: no mask needed there.
            full_hi = tl.minimum(kv_hi, ctx_len + row0 + 1)
            num_full = tl.maximum(full_hi - kv_lo, 0) // BLOCK_N
            masked_lo = kv_lo + num_full * BLOCK_N

            acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
            k_base = k_ptr + kv_head.to(tl.int64) * stride_k_head
            v_base = v_ptr + kv_head.to(tl.int64) * stride_v_head
            if PIPELINE_QK:
                # q.k of tile n+1 is issued before the softmax and PV of tile n, so the tensor
                # cores work on the next scores while the exp2s of this tile run.
                if num_full > 0:
                    k = _load_kv_tile(
                        k_base, bt_row_ptr, kv_lo, kv_hi, stride_k_blk, stride_k_tok, offs_d,
                        d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    )
                    s = _tile_scores(q, k, kv_lo, kv_hi, q_pos, BLOCK_N, False, DOT_PRECISION)
                    for start in range(kv_lo + BLOCK_N, masked_lo, BLOCK_N):
                        k = _load_kv_tile(
                            k_base, bt_row_ptr, start, kv_hi, stride_k_blk, stride_k_tok,
                            offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                        )
                        s_next = _tile_scores(
                            q, k, start, kv_hi, q_pos, BLOCK_N, False, DOT_PRECISION
                        )
                        v = _load_kv_tile(
                            v_base, bt_row_ptr, start - BLOCK_N, kv_hi, stride_v_blk,
                            stride_v_tok, offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                        )
                        acc, m_i, l_i = _softmax_update(
                            s, v, acc, m_i, l_i, scale_log2, LAZY_RESCALE, DOT_PRECISION
                        )
                        s = s_next
                    v = _load_kv_tile(
                        v_base, bt_row_ptr, masked_lo - BLOCK_N, kv_hi, stride_v_blk,
                        stride_v_tok, offs_d, d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    )
                    acc, m_i, l_i = _softmax_update(
                        s, v, acc, m_i, l_i, scale_log2, LAZY_RESCALE, DOT_PRECISION
                    )
            else:
                for start in range(kv_lo, masked_lo, BLOCK_N):
                    k = _load_kv_tile(
                        k_base, bt_row_ptr, start, kv_hi, stride_k_blk, stride_k_tok, offs_d,
                        d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    )
                    v = _load_kv_tile(
                        v_base, bt_row_ptr, start, kv_hi, stride_v_blk, stride_v_tok, offs_d,
                        d_mask, BLOCK_N, PAGE_SIZE, False, EVEN_D,
                    )
                    s = _tile_scores(q, k, start, kv_hi, q_pos, BLOCK_N, False, DOT_PRECISION)
                    acc, m_i, l_i = _softmax_update(
                        s, v, acc, m_i, l_i, scale_log2, LAZY_RESCALE, DOT_PRECISION
                    )
            # The tiles holding the diagonal (and the ragged end): the only masked ones.
            for start in range(masked_lo, kv_hi, BLOCK_N):
                k = _load_kv_tile(
                    k_base, bt_row_ptr, start, kv_hi, stride_k_blk, stride_k_tok, offs_d,
                    d_mask, BLOCK_N, PAGE_SIZE, True, EVEN_D,
                )
                v = _load_kv_tile(
                    v_base, bt_row_ptr, start, kv_hi, stride_v_blk, stride_v_tok, offs_d,
                    d_mask, BLOCK_N, PAGE_SIZE, True, EVEN_D,
                )
                s = _tile_scores(q, k, start, kv_hi, q_pos, BLOCK_N, True, DOT_PRECISION)
                acc, m_i, l_i = _softmax_update(
                    s, v, acc, m_i, l_i, scale_log2, LAZY_RESCALE, DOT_PRECISION
                )

            if USE_PDL:
                # After the last KV load: the next kernel (the o projection streaming its
                # weights, or the merge) launches only once every program of this grid got
                # here or exited, so it takes no SM slot from a tile still to be scheduled.
                tl.extra.cuda.gdc_launch_dependents()
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            result = acc / l_safe[:, None]  # [BLOCK_M, D_PAD]
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


# Width of the kernel's sequence search: one padded width up to 255 sequences per round.
_MIN_SEQS_PAD = 256
# Width of the merge kernel's split vector: one padded width up to 32 splits.
_MIN_SPLITS_PAD = 32


def splits_pad(num_splits: int) -> int:
    """The merge kernel's split-vector width (a constexpr): the split count itself is a
    runtime argument, so a changing count compiles nothing new."""
    return max(_MIN_SPLITS_PAD, _next_pow2(num_splits))


def seqs_pad(num_seqs: int) -> int:
    """The kernel's sequence-search width for a round of `num_seqs` sequences (a constexpr)."""
    return max(_MIN_SEQS_PAD, _next_pow2(num_seqs + 1))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_rows_per_tile(max_block_m: int, group: int, rows_hint: int) -> int:
    """Rows of one sequence per program: all of them up to `max_block_m` query vectors.

    A tile never spans sequences, so rows beyond `rows_hint` (the deepest sequence) would only
    be padding. Past the cap a sequence takes several tiles (16 rows x GQA 8 under a 64-vector
    cap: two 8-row tiles); they sit next to each other in the grid, so they run at the same time
    and the second read of the shared KV mostly hits L2.
    """
    rows_cap = max(1, max_block_m // _next_pow2(group))
    return min(_next_pow2(max(1, rows_hint)), _next_pow2(rows_cap))


def programs_per_sm(device: torch.device, block_m: int) -> int:
    """Programs of `block_m` query vectors one SM holds at once (the arch table's figure)."""
    tiles = arch_config(device).attention
    if block_m <= 16:
        return tiles.programs_per_sm_m16
    if block_m <= 32:
        return tiles.programs_per_sm_m32
    return tiles.programs_per_sm if block_m <= 64 else tiles.programs_per_sm_large


def split_slots(device: torch.device, block_m: int) -> int:
    """Program slots of the whole GPU for tiles of `block_m` query vectors."""
    return programs_per_sm(device, block_m) * num_compute_units(device)


def choose_num_splits(
    device: torch.device,
    num_tiles: int,
    num_kv_heads: int,
    max_kv_len: int,
    *,
    block_m: int = 64,
) -> int:
    """Splits so that tiles x heads x splits fills the GPU's program slots, from shapes only.

    The count rounds down: one program past a full wave costs a second wave of the same
    length. `max_kv_len` is the block table's capacity, an upper bound of every sequence's
    length; a split is worth launching only for `min_split_len` tokens or more, or
    `min_split_len_short` at short contexts (where few long splits leave slots idle).
    """
    tiles = arch_config(device).attention
    programs = max(1, num_tiles * num_kv_heads)
    want = split_slots(device, block_m) // programs
    short = max_kv_len < tiles.short_ctx_len
    worth = max(1, max_kv_len // (tiles.min_split_len_short if short else tiles.min_split_len))
    return max(1, min(want, worth, tiles.max_splits))


@dataclass(frozen=True)
class AttentionLaunch:
    """Tiling of one verify-attention call, from shapes and the arch table only."""

    rows_per_tile: int
    block_m: int  # query vectors per program (rows_per_tile x padded group, >= 16)
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    num_tiles: int  # grid axis 0
    lazy_rescale: bool
    pipeline_qk: bool
    max_regs: int  # 0: the compiler's choice


def fallback_fill_pct(
    device: torch.device, block_m: int, programs: int, num_splits: int, max_kv_len: int
) -> float:
    """Percent of the program slots a grid of `programs` per split x `num_splits` fills, as the
    fallback rule counts it: without its splits at short contexts (under `short_ctx_len`
    tokens), where a split's partials and merge cost about what the extra programs save."""
    tiles = arch_config(device).attention
    counted_splits = num_splits if max_kv_len >= tiles.short_ctx_len else 1
    return 100 * programs * counted_splits / split_slots(device, block_m)


def _tile_grid(
    device: torch.device,
    *,
    rows_per_tile: int,
    group: int,
    num_rows: int,
    num_seqs: int,
    num_kv_heads: int,
    max_kv_len: int,
    num_splits: int | None,
) -> tuple[int, int, int]:
    """(block_m, programs per split, num_splits) of tiles of `rows_per_tile` rows; programs per
    split is tiles x KV heads, splits the given count or the one that fills the slots."""
    block_m = max(16, _next_pow2(rows_per_tile * _next_pow2(group)))  # tl.dot needs M >= 16
    # Sequences of fewer rows than a tile still take a tile each.
    est_tiles = max(triton.cdiv(num_rows, rows_per_tile), min(num_seqs, num_rows))
    if num_splits is None:
        num_splits = choose_num_splits(device, est_tiles, num_kv_heads, max_kv_len, block_m=block_m)
    assert num_splits >= 1
    return block_m, max(1, est_tiles * num_kv_heads), num_splits


def plan_launch(
    device: torch.device,
    *,
    num_rows: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_kv_len: int,
    max_q_len: int | None = None,
    rows_per_tile: int | None = None,
    num_splits: int | None = None,
) -> AttentionLaunch:
    """Tile, splits, warps and stages for a call (see `verify_attention` for the arguments):
    the one place that reads the arch table's tiles, from host-known shapes only (so a captured
    graph replays the launch it was captured with).

    - Rows per tile: all of a sequence's rows up to `max_block_m` query vectors. A tile of more
      than 64 vectors whose grid (tiles x KV heads x splits; without the splits at contexts
      under `short_ctx_len`) would fill less than `min_fill_pct_large` percent of its program
      slots falls back to tiles of up to 64 vectors: twice the programs keep more SMs busy than
      one read of the KV per sequence saves. A `rows_per_tile` the caller gives is kept.
    - Splits: as many as fill one wave of program slots, each at least `min_split_len` KV
      tokens long (`min_split_len_short` at contexts under `short_ctx_len`), see
      `choose_num_splits`; a `num_splits` the caller gives is kept.
    - Stages: tiles of more than 64 vectors take `num_stages_large_split` in split launches (one
      wave of programs) and `num_stages_large` otherwise. A split launch of smaller tiles takes
      `num_stages_split` when its split count was capped (by `max_splits` or by the context
      length) below the count that fills the program slots: such a grid leaves slots free
      (batch 1 at long context), so a deeper pipeline per program pays off, while a grid that
      fills the slots keeps the stage count they were counted at.
    """
    tiles = arch_config(device).attention
    group = num_q_heads // num_kv_heads
    shape = {
        "group": group,
        "num_rows": num_rows,
        "num_seqs": num_seqs,
        "num_kv_heads": num_kv_heads,
        "max_kv_len": max_kv_len,
        "num_splits": num_splits,
    }
    if rows_per_tile is None:
        rows_hint = max_q_len if max_q_len is not None else triton.cdiv(num_rows, max(1, num_seqs))
        rows_per_tile = choose_rows_per_tile(tiles.max_block_m, group, rows_hint)
        block_m, programs, splits = _tile_grid(device, rows_per_tile=rows_per_tile, **shape)
        fill_pct = fallback_fill_pct(device, block_m, programs, splits, max_kv_len)
        if block_m > 64 and fill_pct < tiles.min_fill_pct_large:
            rows_per_tile = choose_rows_per_tile(min(64, tiles.max_block_m), group, rows_hint)
    assert rows_per_tile >= 1
    block_m, programs, num_splits = _tile_grid(device, rows_per_tile=rows_per_tile, **shape)
    large = block_m > 64
    if large:
        block_n, num_warps = tiles.block_n_large, tiles.num_warps_large
        num_stages = tiles.num_stages_large_split if num_splits > 1 else tiles.num_stages_large
    else:
        block_n, num_warps, num_stages = tiles.block_n, tiles.num_warps, tiles.num_stages
        if 1 < num_splits < split_slots(device, block_m) // programs:
            num_stages = tiles.num_stages_split
    return AttentionLaunch(
        rows_per_tile=rows_per_tile,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_splits=num_splits,
        num_tiles=triton.cdiv(num_rows, rows_per_tile) + num_seqs,
        lazy_rescale=bool(tiles.lazy_rescale),
        pipeline_qk=bool(tiles.pipeline_qk),
        max_regs=tiles.max_regs_large if large else tiles.max_regs,
    )


def merge_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    cu_q_lens: torch.Tensor,
    num_seqs: int,
) -> torch.Tensor:
    """Combines per-split partial outputs [splits, rows, Hq, D] (fp32, each normalised) and
    their log2-sum-exps [splits, rows, Hq] into out [rows, Hq, D]; rows past cu_q_lens[-1]
    are left alone."""
    num_splits, num_rows, num_q_heads, head_dim = part_out.shape
    d_pad = _next_pow2(head_dim)
    _merge_splits_kernel[(num_rows, num_q_heads)](
        part_out, part_lse, out, cu_q_lens, num_seqs, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=splits_pad(num_splits),
        num_warps=4 if d_pad >= 128 else 2, **pdl_options(out.device),
    )
    return out


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_q_len: int | None = None,
    rows_per_tile: int | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new rows over the paged cache; returns out [num_rows, Hq, D].

    max_q_len: host-side bound on rows per sequence (the spec depth of a decode round, the chunk
        length with prefill); it only sizes the tile and never changes results. None takes the
        mean rows per sequence, exact for uniform batches; longer sequences then span several
        tiles (their KV is read once per tile).
    rows_per_tile: force rows per program (1 gives the per-row baseline that re-reads KV).
    num_splits: KV splits per tile; None picks from the shapes and the GPU size.
    """
    num_rows, num_q_heads, head_dim = q.shape  # [num_rows, Hq, D]
    _, page_size, num_kv_heads, head_dim_k = k_cache.shape  # [blocks, bs, Hkv, D]
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache must have one shape"
    assert head_dim_k == head_dim, f"head_dim {head_dim} != cache head_dim {head_dim_k}"
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must share a dtype"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {q.dtype}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert cu_q_lens.shape == (num_seqs + 1,) and cu_q_lens.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    devices = {t.device for t in (k_cache, v_cache, cu_q_lens, seq_lens, block_tables)}
    assert devices == {q.device}, f"all tensors must be on {q.device}, got {devices}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert cu_q_lens.is_contiguous() and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_rows == 0:
        return out

    launch = plan_launch(
        q.device,
        num_rows=num_rows,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        max_kv_len=block_tables.shape[1] * page_size,
        max_q_len=max_q_len,
        rows_per_tile=rows_per_tile,
        num_splits=num_splits,
    )
    return _run(q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, scale, launch)


def _run(q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, scale, launch):
    """Launches verify attention (and the merge of its splits) with a planned tiling."""
    num_rows, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    splits = launch.num_splits
    if splits > 1:
        part_out = torch.empty(
            (splits, num_rows, num_q_heads, head_dim), dtype=torch.float32, device=q.device
        )  # [splits, num_rows, Hq, D]
        part_lse = torch.empty(
            (splits, num_rows, num_q_heads), dtype=torch.float32, device=q.device
        )  # [splits, num_rows, Hq]
    else:
        part_out = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)

    group = num_q_heads // num_kv_heads
    d_pad = _next_pow2(head_dim)
    tiles = arch_config(q.device).attention
    grid = (launch.num_tiles, num_kv_heads, splits)
    _verify_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        cu_q_lens, seq_lens, block_tables,
        num_seqs, num_rows, splits, scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=_next_pow2(group), ROWS_TILE=launch.rows_per_tile,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HEAD_DIM=head_dim, D_PAD=d_pad,
        EVEN_D=head_dim == d_pad, PAGE_SIZE=page_size, SPLIT=splits > 1,
        SEQS_PAD=seqs_pad(num_seqs),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LAZY_RESCALE=launch.lazy_rescale, PIPELINE_QK=launch.pipeline_qk,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        **launch_options(q.device, tiles.waves_per_eu, launch.max_regs),
        **pdl_options(q.device),
    )
    if splits > 1:
        merge_splits(part_out, part_lse, out, cu_q_lens, num_seqs)
    return out


def variant_key(launch: AttentionLaunch, num_seqs: int) -> tuple:
    """What selects a compiled kernel among one model's launches (its heads, head size, page
    size and dtype fixed): the tiling's compile-time values. Split counts, sequence and row
    counts are runtime arguments."""
    return (
        launch.rows_per_tile,
        launch.block_m,
        launch.block_n,
        launch.num_warps,
        launch.num_stages,
        launch.num_splits > 1,
        launch.max_regs,
        launch.lazy_rescale,
        launch.pipeline_qk,
        seqs_pad(num_seqs),
    )


def reachable_variants(
    device: torch.device,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    page_size: int,
    max_seqs: int,
    max_q_len: int,
    max_kv_len: int,
) -> dict[tuple, tuple[AttentionLaunch, int]]:
    """Every compiled variant `plan_launch` can pick for rounds of up to `max_seqs` sequences
    with up to `max_q_len` rows each (uniform groups, and one long group beside single rows)
    over block tables of up to `max_kv_len` tokens: {variant key: (a launch, its num_seqs)}."""

    def powers(limit: int) -> list[int]:
        return sorted({1 << i for i in range(limit.bit_length()) if 1 << i <= limit} | {limit})

    found: dict[tuple, tuple[AttentionLaunch, int]] = {}
    for num_seqs in powers(max_seqs):
        for q_len in powers(max_q_len):
            for num_rows in {num_seqs * q_len, num_seqs - 1 + q_len}:
                for kv_len in _kv_lens(page_size, max_kv_len):
                    if kv_len < q_len:
                        continue
                    launch = plan_launch(
                        device,
                        num_rows=num_rows,
                        num_seqs=num_seqs,
                        num_q_heads=num_q_heads,
                        num_kv_heads=num_kv_heads,
                        max_kv_len=kv_len,
                        max_q_len=q_len,
                    )
                    found.setdefault(variant_key(launch, num_seqs), (launch, num_seqs))
    return found


def _kv_lens(page_size: int, max_kv_len: int) -> list[int]:
    """Block-table capacities to plan over: every page up to 8k tokens (where the tile rules'
    thresholds sit), then every 256 tokens."""
    dense = list(range(page_size, min(max_kv_len, 8192) + 1, page_size))
    coarse = list(range(dense[-1] + 256, max_kv_len + 1, 256)) if dense else []
    return dense + coarse + ([max_kv_len] if max_kv_len not in dense + coarse else [])


def compile_variants(
    k_cache: torch.Tensor,  # [blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    num_q_heads: int,
    *,
    max_seqs: int,
    max_q_len: int,
    max_kv_len: int,
) -> int:
    """Compiles every verify-attention variant a model's rounds can pick (see
    `reachable_variants`) by running each once on a dummy batch whose output is thrown away
    (the cache is only read). A serving round never waits for a compile (seconds) this way;
    Triton's disk cache makes later starts fast. Returns the number of variants."""
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    variants = reachable_variants(
        device,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        max_seqs=max_seqs,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
    )
    for launch, num_seqs in variants.values():
        # one tile's rows per sequence (the key's sequence-search width needs the count)
        rows = launch.rows_per_tile
        q = torch.zeros(
            (num_seqs * rows, num_q_heads, head_dim), dtype=k_cache.dtype, device=device
        )  # [R, Hq, D]
        cu_q_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * rows
        seq_lens = torch.full((num_seqs,), rows, dtype=torch.int32, device=device)
        width = -(-rows // page_size)
        block_tables = torch.zeros((num_seqs, width), dtype=torch.int32, device=device)
        dummy = dataclasses.replace(launch, num_tiles=2 * num_seqs)
        out = torch.empty_like(q)
        _run(q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, 1.0, dummy)
    return len(variants)


def verify_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_q_len: int | None = None,
    rows_per_tile: int | None = None,
) -> torch.Tensor:
    """Pure torch, any device (the CPU path); fp32 math. Tiling arguments are accepted and
    ignored. Rows after cu_q_lens[-1] are zeroed, as the kernel does. Reads lengths on the host."""
    del num_splits, max_q_len, rows_per_tile
    _, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    lens = seq_lens.tolist()
    out[cu[-1] :].zero_()
    for seq, (q_start, q_end) in enumerate(itertools.pairwise(cu)):
        q_len, kv_len = q_end - q_start, lens[seq]
        if q_len == 0:
            continue
        pages = block_tables[seq, : triton.cdiv(kv_len, page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()  # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()  # [L, Hkv, D]
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        qs = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, q_len, L]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
