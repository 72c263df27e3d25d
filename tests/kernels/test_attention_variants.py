"""Every verify-attention variant the arch table can select computes the same attention.

The variants (lazy rescaling, q.k issued one tile ahead, tiles of more than 64 query vectors
with their own block_n / warps / stages, split launches) are switched on in the table entry the
interpreter uses, so these tests run on the CPU as well as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import arch
from kernels.attention import (
    choose_num_splits,
    plan_launch,
    programs_per_sm,
    verify_attention,
    verify_attention_ref,
)
from tests.kernels.paged import check_attention, ragged_batch, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"

VARIANTS = {
    "plain": {},
    "lazy": {"lazy_rescale": 1},
    "pipelined": {"pipeline_qk": 1},
    "lazy+pipelined": {"lazy_rescale": 1, "pipeline_qk": 1},
    "large tiles": {"max_block_m": 128, "block_n_large": 16, "lazy_rescale": 1},
    "small block_n": {"block_n": 16, "lazy_rescale": 1, "pipeline_qk": 1},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_variant_matches_reference(tiles, variant, num_splits):
    tiles(**VARIANTS[variant])
    # 16 rows x GQA 8 (one 128-vector tile under the large cap), a decode row, a short verify
    # whose context is shorter than one KV tile, and a padded sequence.
    batch = ragged_batch(
        [16, 1, 5, 0],
        [70, 45, 3, 0],
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
        page_size=8,
        dtype=torch.float32,
        device=DEV,
    )
    check_attention(batch, num_splits=num_splits, max_q_len=16)


@pytest.mark.parametrize("lazy", [0, 1])
def test_scores_growing_across_tiles_are_rescaled(tiles, lazy):
    # Keys grow in magnitude along the sequence, so each KV tile raises the running max by far
    # more than the lazy threshold (2**8 in probability): every rescale must still happen.
    tiles(lazy_rescale=lazy, block_n=16)
    q, k, v, cu, lens, bt = ragged_batch(
        [4],
        [120],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        page_size=16,
        dtype=torch.float32,
        device=DEV,
        seed=3,
    )
    ramp = torch.linspace(0.1, 6.0, k.shape[0] * k.shape[1], device=DEV).view(k.shape[:2])
    k = k * ramp[:, :, None, None]
    q = q * 40.0  # the max grows by hundreds in log2 units: no rescale would overflow fp32
    check_attention((q, k, v, cu, lens, bt), num_splits=1, max_q_len=4)


def test_fp16_variant_with_odd_head_dim(tiles):
    tiles(lazy_rescale=1, pipeline_qk=1)
    batch = ragged_batch(
        [3, 8],
        [50, 20],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=80,
        page_size=4,
        dtype=torch.float16,
        device=DEV,
    )
    check_attention(batch, num_splits=2, max_q_len=8)


def test_large_tiles_take_their_own_settings(tiles):
    t = tiles(max_block_m=128, block_n_large=32, num_warps_large=8, num_stages_large=3)
    dev = torch.device(DEV)
    shape = {"num_q_heads": 64, "num_kv_heads": 8, "max_kv_len": 8192}
    large = plan_launch(dev, num_rows=256, num_seqs=16, max_q_len=16, num_splits=1, **shape)
    small = plan_launch(dev, num_rows=128, num_seqs=16, max_q_len=8, num_splits=1, **shape)
    assert (large.block_m, large.block_n, large.num_warps, large.num_stages) == (128, 32, 8, 3)
    assert (small.block_m, small.block_n, small.num_warps) == (64, t.block_n, t.num_warps)
    assert small.num_stages == t.num_stages
    assert large.max_regs == t.max_regs_large and small.max_regs == t.max_regs


def test_split_stages_only_where_the_split_count_was_capped(tiles):
    # 8 programs (one 64-vector tile x 8 KV heads) and 8 x units slots: 8 splits fill them.
    t = tiles(
        num_stages=1, num_stages_split=3, programs_per_sm=8, max_splits=1 << 12, short_ctx_len=0
    )
    dev = torch.device(DEV)
    shape = {"num_rows": 8, "num_seqs": 1, "num_q_heads": 64, "num_kv_heads": 8}
    fill = arch.num_compute_units(dev) * t.programs_per_sm // 8
    filled = plan_launch(dev, max_kv_len=1 << 20, **shape)
    capped = plan_launch(dev, max_kv_len=t.min_split_len * 2, **shape)
    assert filled.num_splits == fill and filled.num_stages == t.num_stages
    assert capped.num_splits == 2 < fill and capped.num_stages == t.num_stages_split
    unsplit = plan_launch(dev, max_kv_len=1 << 20, num_splits=1, **shape)
    assert unsplit.num_stages == t.num_stages


def test_programs_per_sm_follow_the_tile_size(tiles):
    t = tiles(
        programs_per_sm_m16=5, programs_per_sm_m32=4, programs_per_sm=3, programs_per_sm_large=2
    )
    dev = torch.device(DEV)
    sizes = {
        16: t.programs_per_sm_m16,
        32: t.programs_per_sm_m32,
        64: t.programs_per_sm,
        128: t.programs_per_sm_large,
    }
    for block_m, per_sm in sizes.items():
        assert programs_per_sm(dev, block_m) == per_sm


@settings(max_examples=60, deadline=None)
@given(
    num_tiles=st.integers(1, 600),
    num_kv_heads=st.sampled_from([1, 2, 8]),
    max_kv_len=st.integers(16, 1 << 17),
    block_m=st.sampled_from([16, 32, 64, 128]),
)
def test_splits_never_spill_into_a_partial_wave(num_tiles, num_kv_heads, max_kv_len, block_m):
    device = torch.device(DEV)
    cfg = arch.arch_config(device).attention
    slots = programs_per_sm(device, block_m) * arch.num_compute_units(device)
    splits = choose_num_splits(device, num_tiles, num_kv_heads, max_kv_len, block_m=block_m)
    programs = num_tiles * num_kv_heads
    assert 1 <= splits <= cfg.max_splits
    if splits > 1:
        assert programs * splits <= slots  # the split grid fits one wave
        min_split = cfg.min_split_len_short if max_kv_len < cfg.short_ctx_len else cfg.min_split_len
        assert max_kv_len // splits >= min_split  # each split worth its launch
        # as many splits as the wave, the cap and the length allow
        assert (
            programs * (splits + 1) > slots
            or splits == cfg.max_splits
            or max_kv_len // min_split == splits
        )


def _sweep_changes() -> list[dict]:
    from loadtests.lab.kernels.common import RULE_VARIANTS, SWEEP_PHASES, sweep_tasks

    changes = [c for phase in SWEEP_PHASES for c, _ in sweep_tasks(phase)]
    changes += [c for _, c in RULE_VARIANTS]  # the candidates of `--sweep`
    # Winners of different classes combine: one case with every switch and large tiles on.
    changes.append(
        {
            "lazy_rescale": 1,
            "pipeline_qk": 1,
            "max_block_m": 128,
            "num_stages_large": 3,
            "num_stages_split": 3,
        }
    )
    return list({str(sorted(c.items())): c for c in changes}.values())


@pytest.mark.gpu
@pytest.mark.parametrize("changes", _sweep_changes(), ids=lambda c: str(c) or "entry")
def test_every_swept_variant_bf16(tiles, changes):
    # Shapes of the benchmark (head_dim 128, GQA 8, 16-token pages) in one ragged batch:
    # 16-row verifies, decode rows, an 8-row verify, a 300-row prefill chunk, a padded sequence.
    tiles(**changes)
    batch = ragged_batch(
        [16, 16, 1, 8, 300, 1, 0],
        [3000, 40, 2000, 900, 100, 0, 0],
        num_q_heads=64,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        pad_rows=2,
    )
    q = batch[0]
    ref = verify_attention_ref(*[t.float() if t.is_floating_point() else t for t in batch], 0.088)
    for num_splits in (None, 1, 5):
        out = torch.full_like(q, float("nan"))
        verify_attention(*batch, 0.088, out, num_splits=num_splits, max_q_len=16)
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-2
