"""Argmax and top-k (k <= 32) over large vocabularies for many rows at once.

Two launches, both with grids fixed by shapes:
1. grid (rows, chunks): each program takes `vocab_chunk` entries of one row and finds its k
   best (value, id) pairs;
2. grid (rows,): one program merges the chunks' candidates of its row the same way.

Argmax (k = 1) extracts the best by one round of max-then-smallest-id. For k >= 2 each
(value, id) pair is packed into one int64 key that orders as the pairs do: the float's bits
mapped to an order-preserving int32 in the high half, 2**32 - 1 - id in the low half, so a
single bitonic top-k (`tl.topk`, k padded to a power of two) replaces k rounds of max and min
over the chunk. Where Triton lacks `tl.topk`, k rounds of max-then-smallest-id do it.

Order: larger value first; equal values by smaller vocabulary id (as torch.argmax picks the first
maximum); -0.0 counts as 0.0. NaN logits are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options

MAX_TOP_K = 32
_NO_ID = 2**62  # larger than every vocabulary id: marks a removed or padding candidate
# packed keys: ids must fit the low 32 bits; a padding key sorts below every packed pair
MAX_PACKED_VOCAB = 2**32
_PAD_KEY = -(2**63)
HAS_TL_TOPK = hasattr(tl, "topk")


@triton.jit
def _extract_top_k(vals, ids, out_val_ptr, out_id_ptr, K: tl.constexpr):
    """Writes the K best of (vals, ids) to out_*[0:K]; entries with id _NO_ID never win."""
    for i in tl.static_range(K):
        alive = ids < 4611686018427387904  # _NO_ID
        best = tl.max(tl.where(alive, vals, float("-inf")), 0)
        best_id = tl.min(tl.where(alive & (vals == best), ids, 4611686018427387904), 0)
        tl.store(out_val_ptr + i, best)
        tl.store(out_id_ptr + i, best_id)
        ids = tl.where(ids == best_id, 4611686018427387904, ids)


@triton.jit
def _chunk_top_k_kernel(
    logits_ptr, part_val_ptr, part_id_ptr, vocab, stride_row, num_chunks,
    CHUNK: tl.constexpr, K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < vocab
    vals = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf"))
    ids = tl.where(valid, offs.to(tl.int64), 4611686018427387904)  # [CHUNK]
    base = (row * num_chunks + chunk) * K
    _extract_top_k(vals.to(tl.float32), ids, part_val_ptr + base, part_id_ptr + base, K)


@triton.jit
def _merge_top_k_kernel(
    part_val_ptr, part_id_ptr, out_val_ptr, out_id_ptr, num_cands,
    CANDS_PAD: tl.constexpr, K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDS_PAD)
    valid = offs < num_cands
    vals = tl.load(part_val_ptr + row * num_cands + offs, mask=valid, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * num_cands + offs, mask=valid, other=4611686018427387904)
    _extract_top_k(vals, ids, out_val_ptr + row * K, out_id_ptr + row * K, K)


@triton.jit
def _pack_keys(vals, ids):
    """(fp32 values, int64 ids) -> int64 keys ordered by value, then by smaller id."""
    bits = (vals + 0.0).to(tl.int32, bitcast=True)  # (+0.0 turns -0.0 into 0.0)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order = float order
    return (key.to(tl.int64) << 32) | (4294967295 - ids)


@triton.jit
def _store_unpacked(keys, out_val_ptr, out_id_ptr, K: tl.constexpr, K_PAD: tl.constexpr):
    """Writes the first K of K_PAD sorted packed keys as (value, id)."""
    offs = tl.arange(0, K_PAD)
    key = (keys >> 32).to(tl.int32)
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    ids = 4294967295 - (keys & 4294967295)
    tl.store(out_val_ptr + offs, bits.to(tl.float32, bitcast=True), mask=offs < K)
    tl.store(out_id_ptr + offs, ids, mask=offs < K)


@triton.jit
def _chunk_top_k_sorted_kernel(
    logits_ptr, part_ptr, vocab, stride_row, num_chunks,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < vocab
    vals = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=0.0)
    keys = _pack_keys(vals.to(tl.float32), offs.to(tl.int64))
    keys = tl.where(valid, keys, -9223372036854775808)  # _PAD_KEY  # [CHUNK]
    top = tl.topk(keys, K_PAD)  # [K_PAD], largest first
    tl.store(part_ptr + (row * num_chunks + chunk) * K_PAD + tl.arange(0, K_PAD), top)


@triton.jit
def _merge_top_k_sorted_kernel(
    part_ptr, out_val_ptr, out_id_ptr, num_cands,
    CANDS_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CANDS_PAD)
    keys = tl.load(
        part_ptr + row * num_cands + offs, mask=offs < num_cands, other=-9223372036854775808
    )
    top = tl.topk(keys, K_PAD)  # [K_PAD]
    _store_unpacked(top, out_val_ptr + row * K, out_id_ptr + row * K, K, K_PAD)


def _top_k_sorted(logits: torch.Tensor, k: int, chunk: int, opts: dict, num_warps: int):
    """k >= 2 through packed keys and `tl.topk` (see the module doc)."""
    num_rows, vocab = logits.shape  # [N, V]
    k_pad = triton.next_power_of_2(k)
    chunk = max(chunk, k_pad)
    num_chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    part = torch.empty((num_rows, num_chunks, k_pad), dtype=torch.int64, device=dev)
    values = torch.empty((num_rows, k), dtype=torch.float32, device=dev)  # [N, k]
    ids = torch.empty((num_rows, k), dtype=torch.int64, device=dev)  # [N, k]
    if num_rows == 0:
        return values.to(logits.dtype), ids
    _chunk_top_k_sorted_kernel[(num_rows, num_chunks)](
        logits, part, vocab, logits.stride(0), num_chunks,
        CHUNK=chunk, K_PAD=k_pad, num_warps=num_warps, **opts,
    )
    num_cands = num_chunks * k_pad
    _merge_top_k_sorted_kernel[(num_rows,)](
        part, values, ids, num_cands,
        CANDS_PAD=triton.next_power_of_2(num_cands), K=k, K_PAD=k_pad,
        num_warps=num_warps, **opts,
    )
    return values.to(logits.dtype), ids


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, vocab = logits.shape  # [N, V]
    assert logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert logits.stride(1) == 1, "logits need a contiguous last dim"
    assert 1 <= k <= min(MAX_TOP_K, vocab), f"k must be in [1, {min(MAX_TOP_K, vocab)}]"
    cfg = arch_config(logits.device)
    chunk = min(cfg.vocab_chunk, triton.next_power_of_2(vocab))
    if k > 1 and HAS_TL_TOPK and vocab <= MAX_PACKED_VOCAB:
        opts = launch_options(logits.device, cfg.waves_per_eu)
        return _top_k_sorted(logits, k, chunk, opts, cfg.row_warps)
    num_chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    part_val = torch.empty((num_rows, num_chunks, k), dtype=torch.float32, device=dev)
    part_id = torch.empty((num_rows, num_chunks, k), dtype=torch.int64, device=dev)
    values = torch.empty((num_rows, k), dtype=torch.float32, device=dev)  # [N, k]
    ids = torch.empty((num_rows, k), dtype=torch.int64, device=dev)  # [N, k]
    if num_rows == 0:
        return values.to(logits.dtype), ids
    opts = launch_options(dev, cfg.waves_per_eu)
    _chunk_top_k_kernel[(num_rows, num_chunks)](
        logits, part_val, part_id, vocab, logits.stride(0), num_chunks,
        CHUNK=chunk, K=k, num_warps=cfg.row_warps, **opts,
    )
    num_cands = num_chunks * k
    _merge_top_k_kernel[(num_rows,)](
        part_val, part_id, values, ids, num_cands,
        CANDS_PAD=triton.next_power_of_2(num_cands), K=k, num_warps=cfg.row_warps, **opts,
    )
    return values.to(logits.dtype), ids


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> ids [N] int64 of the first maximum of each row."""
    return _top_k(logits, 1)[1][:, 0]


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (values [N, k] in logits' dtype, ids [N, k] int64), best first."""
    return _top_k(logits, k)


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def topk_rows_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same order as the kernel: a stable sort on the negated values breaks ties by id."""
    order = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k]
    return logits.gather(1, order), order
