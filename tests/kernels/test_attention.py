"""Verify attention against the torch reference on random ragged batches (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import (
    choose_num_splits,
    choose_rows_per_tile,
    verify_attention,
)
from tests.kernels.paged import check_attention, ragged_batch, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# One sequence: (rows, cached tokens before them); rows 0 is a padded sequence.
_seq = st.one_of(
    st.tuples(st.just(1), st.integers(0, 70)),  # AR row
    st.tuples(st.integers(2, 9), st.integers(0, 70)),  # speculative verify
    st.tuples(st.integers(10, 40), st.integers(0, 40)),  # prefill chunk
    st.tuples(st.just(0), st.just(0)),  # graph padding
)


@settings(max_examples=14)
@given(
    seqs=st.lists(_seq, min_size=1, max_size=4).filter(lambda s: any(r for r, _ in s)),
    gqa=st.sampled_from([1, 4, 8]),
    head_dim=st.sampled_from([64, 128]),
    page_size=st.sampled_from([4, 16]),
    num_splits=st.sampled_from([1, 3, None]),
    max_q_len=st.sampled_from([None, 1, 8]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    pad_rows=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_reference(
    seqs, gqa, head_dim, page_size, num_splits, max_q_len, dtype, pad_rows, seed
):
    num_kv_heads = 2 if gqa < 8 else 1
    batch = ragged_batch(
        [r for r, _ in seqs],
        [c for _, c in seqs],
        num_q_heads=num_kv_heads * gqa,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        device=DEV,
        pad_rows=pad_rows,
        seed=seed,
    )
    check_attention(batch, pad_rows=pad_rows, num_splits=num_splits, max_q_len=max_q_len)


def test_odd_group_and_head_dim():
    # GQA 3 and head_dim 80 are not powers of two: both get padded and masked.
    batch = ragged_batch(
        [5, 1],
        [33, 70],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=80,
        page_size=8,
        dtype=torch.float32,
        device=DEV,
    )
    check_attention(batch, num_splits=2, max_q_len=8)


def test_per_row_tiles_equal_shared_tiles():
    batch = ragged_batch(
        [8, 3],
        [50, 90],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=torch.float32,
        device=DEV,
    )
    shared = check_attention(batch, max_q_len=8, num_splits=1)
    per_row = check_attention(batch, rows_per_tile=1, num_splits=1)
    assert rel_err(shared, per_row) < 1e-6


def test_long_context_many_splits():
    batch = ragged_batch(
        [2],
        [600],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        page_size=16,
        dtype=torch.float32,
        device=DEV,
    )
    check_attention(batch, num_splits=16, max_q_len=2)


def test_rejects_mismatched_dtypes():
    q, k, v, cu, lens, bt = ragged_batch(
        [1],
        [3],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=4,
        dtype=torch.float32,
    )
    with pytest.raises(AssertionError):
        verify_attention(q.half(), k, v, cu, lens, bt, 0.1)
    with pytest.raises(AssertionError):
        verify_attention(q, k, v, cu.long(), lens, bt, 0.1)


def test_split_choice_fills_the_gpu_and_respects_bounds():
    cpu = torch.device("cpu")
    many = choose_num_splits(cpu, num_tiles=512, num_kv_heads=8, max_kv_len=32768)
    few = choose_num_splits(cpu, num_tiles=1, num_kv_heads=1, max_kv_len=32768)
    short = choose_num_splits(cpu, num_tiles=1, num_kv_heads=1, max_kv_len=256)
    assert many == 1
    assert few > 1
    assert short == 1


@settings(max_examples=40)
@given(
    max_block_m=st.sampled_from([16, 32, 64, 128]),
    group=st.integers(1, 16),
    rows_hint=st.integers(1, 600),
)
def test_tile_rows_respect_the_cap_and_the_deepest_sequence(max_block_m, group, rows_hint):
    rows = choose_rows_per_tile(max_block_m, group, rows_hint)
    group_pad = 1 << (group - 1).bit_length()
    assert rows >= 1 and rows & (rows - 1) == 0
    # Within the cap (one row even when a padded group alone exceeds it), never past the hint's
    # power of two, and as large as both allow.
    assert rows * group_pad <= max(max_block_m, group_pad)
    assert rows < 2 * rows_hint
    assert rows * 2 * group_pad > max_block_m or rows >= rows_hint


def test_sixteen_rows_of_gqa8_take_two_tiles_under_a_64_vector_cap():
    assert choose_rows_per_tile(64, 8, 16) == 8
    assert choose_rows_per_tile(64, 4, 16) == 16
    assert choose_rows_per_tile(64, 4, 1) == 1  # decode: the per-row launch exactly
    assert choose_rows_per_tile(128, 8, 16) == 16


def test_two_tiles_of_one_sequence_match_reference():
    # 16 rows x GQA 8 under a 64-vector cap: two 8-row tiles per 16-row sequence.
    batch = ragged_batch(
        [16, 1, 16],
        [90, 40, 0],
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
        page_size=16,
        dtype=torch.float32,
        device=DEV,
    )
    check_attention(batch, rows_per_tile=8, num_splits=1)
    check_attention(batch, rows_per_tile=8, num_splits=3)
    check_attention(batch, max_q_len=16)


@settings(max_examples=8, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 17), st.integers(0, 50)), min_size=1, max_size=3),
    gqa=st.sampled_from([1, 4]),
    num_splits=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_non_causal_rows_see_the_whole_sequence(seqs, gqa, num_splits, seed):
    """causal=False: every row of a sequence attends to all of its KV, as a one-row sequence
    of the same length would (the causal kernel run row by row is the cross-check)."""
    batch = ragged_batch(
        [r for r, _ in seqs],
        [c for _, c in seqs],
        num_q_heads=2 * gqa,
        num_kv_heads=2,
        head_dim=64,
        page_size=4,
        dtype=torch.float32,
        device=DEV,
        seed=seed,
    )
    out = check_attention(batch, num_splits=num_splits, max_q_len=17, causal=False)
    q, k_cache, v_cache, cu, seq_lens, tables = batch
    row_seq = torch.repeat_interleave(
        torch.arange(len(seqs), device=q.device), cu.diff().long()
    )  # [rows] each row's sequence
    one_row = verify_attention(
        q,
        k_cache,
        v_cache,
        torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device),
        seq_lens[row_seq].contiguous(),
        tables[row_seq].contiguous(),
        q.shape[-1] ** -0.5,
    )
    assert rel_err(out, one_row) < 1e-5
