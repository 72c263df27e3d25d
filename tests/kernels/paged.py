"""Builders of random ragged batches over a paged KV cache, shared by the kernel tests."""

from __future__ import annotations

import math

import torch

from kernels.attention import verify_attention, verify_attention_ref

# tolerance of the kernel against the fp32 reference, by the batch's dtype
ATTENTION_TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def ragged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    pad_rows: int = 0,
    seed: int = 0,
):
    """Returns (q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables).

    Sequence s has ctx_lens[s] cached tokens before its q_lens[s] new rows (q_len 0: a padded
    sequence). Pages are scattered at random over a cache with spare blocks; `pad_rows` extra
    query rows after the last sequence stand for graph padding.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    pages = [-(-n // page_size) for n in seq_lens]
    max_pages = max([*pages, 1]) + 1
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(q_lens), max_pages, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages):
        block_tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_rows = sum(q_lens) + pad_rows
    q = torch.randn(num_rows, num_q_heads, head_dim, generator=gen).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    tensors = (q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), block_tables)
    return tuple(t.to(device) for t in tensors)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check_attention(batch, *, pad_rows: int = 0, **kwargs) -> torch.Tensor:
    """Runs `verify_attention` on a `ragged_batch` into a NaN-poisoned output (every element must
    be written) and checks it against the fp32 reference; graph-padding rows must come out zero.
    Returns the output."""
    q = batch[0]
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.full_like(q, float("nan"))
    verify_attention(*batch, scale, out, **kwargs)
    ref = verify_attention_ref(
        *[t.float() if t.is_floating_point() else t for t in batch],
        scale,
        causal=kwargs.get("causal", True),
    )
    assert not out.isnan().any()
    assert rel_err(out, ref) < ATTENTION_TOL[q.dtype]
    if pad_rows:
        assert (out[-pad_rows:] == 0).all()
    return out
