"""Verify attention: causal attention of ragged new rows over a paged KV cache (one layer).

    q           [num_rows, num_q_heads, head_dim]    new rows of all sequences, back to back
    k/v_cache   [num_blocks, block_size, num_kv_heads, head_dim]  q's dtype, or float8_e4m3fn
    k/v_scale   [num_kv_heads] float32               an FP8 cache's: values are stored * scale
    cu_q_lens   [num_seqs + 1] int32                 rows of sequence s: cu_q_lens[s]..[s+1]-1
    seq_lens    [num_seqs] int32                     KV length incl. the new rows (already cached)
    block_tables[num_seqs, max_blocks] int32         cache block of each block_size-token page
Row j of sequence s sits at position seq_lens[s] - q_len_s + j and attends to positions <= its own;
with `causal=False` every row attends to the sequence's whole KV (a block drafter's block).

The host side lives here: `verify_attention` (checks, plans, launches), its torch reference and
`compile_variants` (start-up compile of every variant a model's rounds can pick). The kernels are
in `kernels.attention_kernel`, the tile rules in `kernels.attention_tiling`; the names callers
use from both are importable from this module too.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import triton

from kernels.arch import arch_config, launch_options, pdl_options
from kernels.attention_kernel import _merge_splits_kernel, _verify_attention_kernel
from kernels.attention_tiling import (
    AttentionLaunch,
    choose_num_splits,
    choose_rows_per_tile,
    fallback_fill_pct,
    next_pow2,
    plan_launch,
    programs_per_sm,
    reachable_variants,
    seqs_pad,
    split_slots,
    splits_pad,
    variant_key,
)
from kernels.kv_fp8 import check_kv_scales, is_fp8, kv_load_ref

__all__ = [
    "AttentionLaunch",
    "choose_num_splits",
    "choose_rows_per_tile",
    "compile_variants",
    "fallback_fill_pct",
    "merge_splits",
    "plan_launch",
    "programs_per_sm",
    "reachable_variants",
    "seqs_pad",
    "split_slots",
    "splits_pad",
    "variant_key",
    "verify_attention",
    "verify_attention_ref",
]


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
    d_pad = next_pow2(head_dim)
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
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ragged new rows over the paged cache; returns out [num_rows, Hq, D].

    max_q_len: host-side bound on rows per sequence (the spec depth of a decode round, the chunk
        length with prefill); it only sizes the tile and never changes results. None takes the
        mean rows per sequence, exact for uniform batches; longer sequences then span several
        tiles (their KV is read once per tile).
    rows_per_tile: force rows per program (1 gives the per-row baseline that re-reads KV).
    num_splits: KV splits per tile; None picks from the shapes and the GPU size.
    causal: False lets every row see all of its sequence's KV (seq_lens[s] tokens).
    k_scale, v_scale: an FP8 cache's per-head scales (ignored for another cache).
    """
    num_rows, num_q_heads, head_dim = q.shape  # [num_rows, Hq, D]
    _, page_size, num_kv_heads, head_dim_k = k_cache.shape  # [blocks, bs, Hkv, D]
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache must have one shape"
    assert head_dim_k == head_dim, f"head_dim {head_dim} != cache head_dim {head_dim_k}"
    assert num_q_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache must share a dtype"
    assert k_cache.dtype == q.dtype or is_fp8(k_cache.dtype), "a cache in q's dtype or fp8"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {q.dtype}"
    check_kv_scales(k_cache, k_scale, v_scale)
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
        head_dim=head_dim,
    )
    return _run(
        q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, scale, launch, causal,
        k_scale, v_scale,
    )


def _run(
    q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, scale, launch, causal=True,
    k_scale=None, v_scale=None,
):
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
    d_pad = next_pow2(head_dim)
    tiles = arch_config(q.device).attention
    grid = (launch.num_tiles, num_kv_heads, splits)
    fp8 = is_fp8(k_cache.dtype)
    _verify_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse,
        cu_q_lens, seq_lens, block_tables,
        k_scale if fp8 else part_lse, v_scale if fp8 else part_lse,
        num_seqs, num_rows, splits, scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group), ROWS_TILE=launch.rows_per_tile,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HEAD_DIM=head_dim, D_PAD=d_pad,
        EVEN_D=head_dim == d_pad, PAGE_SIZE=page_size, SPLIT=splits > 1,
        SEQS_PAD=seqs_pad(num_seqs),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LAZY_RESCALE=launch.lazy_rescale, PIPELINE_QK=launch.pipeline_qk, CAUSAL=causal,
        KV_FP8=fp8,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        **launch_options(q.device, tiles.waves_per_eu, launch.max_regs),
        **pdl_options(q.device),
    )
    if splits > 1:
        merge_splits(part_out, part_lse, out, cu_q_lens, num_seqs)
    return out



def compile_variants(
    k_cache: torch.Tensor,  # [blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    num_q_heads: int,
    *,
    max_seqs: int,
    max_q_len: int,
    max_kv_len: int,
    q_dtype: torch.dtype | None = None,
) -> int:
    """Compiles every verify-attention variant a model's rounds can pick (see
    `reachable_variants`) by running each once on a dummy batch whose output is thrown away
    (the cache is only read). A serving round never waits for a compile (seconds) this way;
    Triton's disk cache makes later starts fast. `q_dtype`: the queries' (the model's) dtype,
    needed for an FP8 cache. Returns the number of variants."""
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
        head_dim=head_dim,
    )
    # an FP8 cache is read by queries of the model's dtype, which the fp8 cache does not tell
    q_dtype = q_dtype or k_cache.dtype
    scales = {}
    if is_fp8(k_cache.dtype):
        ones = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        scales = {"k_scale": ones, "v_scale": ones}
    for launch, num_seqs in variants.values():
        # one tile's rows per sequence (the key's sequence-search width needs the count)
        rows = launch.rows_per_tile
        q = torch.zeros(
            (num_seqs * rows, num_q_heads, head_dim), dtype=q_dtype, device=device
        )  # [R, Hq, D]
        cu_q_lens = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * rows
        seq_lens = torch.full((num_seqs,), rows, dtype=torch.int32, device=device)
        width = -(-rows // page_size)
        block_tables = torch.zeros((num_seqs, width), dtype=torch.int32, device=device)
        dummy = dataclasses.replace(launch, num_tiles=2 * num_seqs)
        out = torch.empty_like(q)
        _run(q, k_cache, v_cache, out, cu_q_lens, seq_lens, block_tables, 1.0, dummy, **scales)
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
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure torch, any device (the CPU path); fp32 math over the cached values (an FP8 cache's
    stored * scale). Tiling arguments are accepted and ignored. Rows after cu_q_lens[-1] are
    zeroed, as the kernel does. Reads lengths on the host."""
    del num_splits, max_q_len, rows_per_tile
    check_kv_scales(k_cache, k_scale, v_scale)
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
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]  # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]  # [L, Hkv, D]
        k, v = kv_load_ref(k, k_scale), kv_load_ref(v, v_scale)  # float32
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        qs = q[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, q_len, L]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        if causal:
            hidden_keys = k_pos[None, None, :] > q_pos[None, :, None]
            scores = scores.masked_fill(hidden_keys, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
