"""The shape rules of `plan_launch` for tiles of more than 64 query vectors: stages by split,
the fall back to 64-vector tiles when their grid fills too few program slots (counted without
splits at short contexts), short contexts' shorter splits, the kernel's results on the paths
those rules choose, and the benchmark's sweep that times the candidates."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import arch
from kernels.attention import choose_rows_per_tile, plan_launch, split_slots
from loadtests.lab.kernels import attention as bench
from loadtests.lab.kernels import common
from tests.kernels.paged import check_attention, ragged_batch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H200_SMS = 132


@pytest.fixture
def h200(monkeypatch):
    """Plans on the CPU as on an H200: the Hopper entry and 132 SMs. The entry is restored."""

    @functools.lru_cache(maxsize=4)  # common.set_attention_tiles clears it after an edit
    def config_for(device_type: str, index: int):
        return arch.FAMILY_CONFIGS["hopper"], H200_SMS

    saved = arch.FAMILY_CONFIGS["hopper"]
    monkeypatch.setattr(arch, "_config_for", config_for)
    yield torch.device("cpu")
    arch.FAMILY_CONFIGS["hopper"] = saved


def _plan(device, batch, ctx, rows, gqa, **kwargs):
    return plan_launch(
        device,
        num_rows=batch * rows,
        num_seqs=batch,
        num_q_heads=8 * gqa,
        num_kv_heads=8,
        max_kv_len=ctx,
        max_q_len=rows,
        **kwargs,
    )


# (batch, ctx, rows, GQA) -> (query vectors per tile, splits, stages) the Hopper entry picks.
H200_PICKS = {
    # Short contexts (under 4096 tokens): the 128-vector grid counted without splits, splits
    # down to 128 tokens.
    (1, 1024, 16, 8): (64, 8, 3),  # 8 of 264 slots -> 64-vector tiles; 8 splits, capped
    (1, 1024, 8, 8): (64, 8, 3),  # 8 programs: 8 splits of 128 tokens, capped below 33
    (8, 1024, 8, 8): (64, 4, 2),  # 64 programs: 4 splits fill 256 of 264
    (16, 1024, 8, 8): (64, 2, 2),  # 128 programs: 2 splits, as with 512-token splits
    (8, 1024, 16, 8): (64, 2, 2),  # 64 of 264 -> 64-vector tiles
    (16, 1024, 16, 8): (64, 1, 2),  # 128 of 264 unsplit -> 64-vector tiles, 256: unsplit
    (16, 2048, 16, 8): (64, 1, 2),
    (64, 1024, 16, 8): (128, 1, 3),  # 512 of 264 unsplit: 128-vector tiles stay
    # 4096 tokens and more: as before the short-context rules.
    (1, 8192, 16, 8): (64, 16, 2),  # 128 of 264 slots (48%) -> 64-vector tiles
    (1, 32768, 16, 8): (128, 32, 2),  # 256 of 264: 128-vector tiles, split: 2 stages
    (16, 4096, 16, 8): (128, 2, 2),
    (16, 8192, 16, 8): (128, 2, 2),
    (16, 32768, 16, 8): (128, 2, 2),
    (64, 8192, 16, 8): (128, 1, 3),  # unsplit, two waves: 3 stages
    (16, 8192, 8, 8): (64, 2, 2),  # 64-vector tiles: neither rule applies
    (1, 8192, 8, 8): (64, 16, 3),  # 512-token splits: 16, capped
}


@pytest.mark.parametrize(("shape", "pick"), list(H200_PICKS.items()), ids=str)
def test_hopper_picks(h200, shape, pick):
    launch = _plan(h200, *shape)
    assert (launch.block_m, launch.num_splits, launch.num_stages) == pick
    assert launch.num_warps == (8 if launch.block_m > 64 else 4)
    assert launch.max_regs == (128 if launch.block_m > 64 else 0)


def test_wide_heads_leave_registers_to_the_compiler(h200):
    """The 128-register cap of 8-warp tiles fits 128-dim heads; a 256-dim head's tile does not
    compile under it, so its launches carry no cap (tiles and splits as for any head)."""
    narrow = _plan(h200, 64, 1024, 16, 8)
    wide = _plan(h200, 64, 1024, 16, 8, head_dim=256)
    assert narrow.block_m == wide.block_m == 128 and narrow.max_regs == 128
    assert wide.max_regs == 0 and wide.num_splits == narrow.num_splits


def test_a_given_tile_or_split_count_is_kept(h200):
    # Rows per tile given by the caller: no fall back, however small the grid.
    forced = _plan(h200, 1, 1024, 16, 8, rows_per_tile=16)
    assert forced.block_m == 128 and forced.num_stages == 2
    # A given split count is the grid's: 8 programs x 32 splits fill 97% of the slots, but at
    # a short context the fill is counted without splits.
    assert _plan(h200, 1, 8192, 16, 8, num_splits=32).block_m == 128
    short = _plan(h200, 1, 2048, 16, 8, num_splits=32)
    assert (short.block_m, short.num_splits) == (64, 32)
    unsplit = _plan(h200, 1, 32768, 16, 8, num_splits=1)  # 8 of 264 slots
    assert (unsplit.block_m, unsplit.num_splits) == (64, 1)


def test_short_context_rules_end_at_the_threshold(h200):
    short_ctx_len = arch.arch_config(h200).attention.short_ctx_len
    assert short_ctx_len == 4096
    below = _plan(h200, 16, short_ctx_len - 16, 16, 8)
    at = _plan(h200, 16, short_ctx_len, 16, 8)
    assert (below.block_m, below.num_splits) == (64, 1)
    assert (at.block_m, at.num_splits) == (128, 2)
    # Splits of 128 tokens below the threshold, 512 from it on: one 64-vector tile x 8 heads.
    assert _plan(h200, 1, short_ctx_len - 16, 8, 8).num_splits == (short_ctx_len - 16) // 128
    assert _plan(h200, 1, short_ctx_len, 8, 8).num_splits == short_ctx_len // 512


# The fixture only patches the device lookup; the test restores the entry it edits.
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    # small batches and short contexts are where 128-vector grids fill few slots
    batch=st.one_of(st.integers(1, 8), st.integers(1, 80)),
    pages=st.one_of(st.integers(1, 128), st.integers(1, 4096)),
    rows=st.integers(1, 16),
    gqa=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_rules_against_the_plan_without_them(h200, batch, pages, rows, gqa):
    ctx = 16 * pages
    picked = _plan(h200, batch, ctx, rows, gqa)
    entry = dataclasses.asdict(arch.arch_config(h200).attention)
    common.set_attention_tiles(h200, min_fill_pct_large=0)
    try:
        plain = _plan(h200, batch, ctx, rows, gqa)  # 128-vector tiles wherever they fit
    finally:
        common.set_attention_tiles(h200, **entry)
    if picked.num_splits > 1:  # each split worth its launch: 128 tokens when short, else 512
        assert ctx // picked.num_splits >= (128 if ctx < 4096 else 512)
    if plain.block_m <= 64:
        assert picked == plain  # small tiles: untouched
        return
    programs = max(-(-batch * rows // plain.rows_per_tile), batch) * 8
    counted = programs * (plain.num_splits if ctx >= 4096 else 1)  # short: splits don't count
    fills = 100 * counted >= 50 * split_slots(h200, plain.block_m)
    if fills:
        assert picked == plain
        assert picked.num_stages == (2 if picked.num_splits > 1 else 3)
    else:
        assert picked.rows_per_tile == choose_rows_per_tile(64, gqa, rows) < plain.rows_per_tile
        assert picked.block_m == 64 and picked.num_warps == 4


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.integers(1, 80),
    pages=st.integers(256, 4096),  # 4096 tokens and more
    rows=st.integers(1, 16),
    gqa=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_long_contexts_plan_as_without_the_short_rules(h200, batch, pages, rows, gqa):
    picked = _plan(h200, batch, 16 * pages, rows, gqa)
    entry = dataclasses.asdict(arch.arch_config(h200).attention)
    common.set_attention_tiles(h200, short_ctx_len=0)
    try:
        assert _plan(h200, batch, 16 * pages, rows, gqa) == picked
    finally:
        common.set_attention_tiles(h200, **entry)


def test_short_context_fall_back_and_splits_compute_the_same_attention(tiles):
    # One sequence of 16 rows x GQA 8 at a short context: one 128-vector program x 4 splits
    # would fill all 4 of the interpreter's large slots, but counted without its splits it
    # fills 25%, so it runs as two 64-vector tiles, each in 4 splits of 16 tokens (2 at the
    # 32-token minimum of longer contexts), merged.
    tiles(
        max_block_m=128, min_fill_pct_large=50, block_n=16, block_n_large=16,
        programs_per_sm=2, programs_per_sm_large=1, min_split_len=32, max_splits=4,
        short_ctx_len=128, min_split_len_short=16,
    )  # fmt: skip
    batch = ragged_batch(
        [16], [50], num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=8,
        dtype=torch.float32, device=DEV,
    )  # fmt: skip
    max_kv_len = batch[5].shape[1] * 8
    assert max_kv_len == 80 < 128
    shape = {"num_rows": 16, "num_seqs": 1, "num_q_heads": 8, "num_kv_heads": 1, "max_q_len": 16}
    launch = plan_launch(torch.device(DEV), max_kv_len=max_kv_len, **shape)
    assert (launch.rows_per_tile, launch.block_m, launch.num_splits) == (8, 64, 4)
    check_attention(batch, max_q_len=16)
    # The same shape as a long context: 2 splits, and the 128-vector grid counts them.
    tiles(
        max_block_m=128, min_fill_pct_large=50, block_n=16, block_n_large=16,
        programs_per_sm=2, programs_per_sm_large=1, min_split_len=32, max_splits=4,
        short_ctx_len=0, min_split_len_short=16,
    )  # fmt: skip
    long = plan_launch(torch.device(DEV), max_kv_len=max_kv_len, **shape)
    assert (long.block_m, long.num_splits) == (128, 2)


def test_fall_back_computes_the_same_attention(tiles):
    # One sequence of 16 rows x GQA 8: one 128-vector program x 2 splits fills 2 of the
    # interpreter's 4 large slots, under the 75% asked here, so it runs as two 64-vector tiles
    # (rows 0-7 and 8-15), each split in 2 and merged.
    tiles(
        max_block_m=128, min_fill_pct_large=75, block_n_large=16, programs_per_sm_large=1,
        min_split_len=16, max_splits=2,
    )  # fmt: skip
    batch = ragged_batch(
        [16], [70], num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=8,
        dtype=torch.float32, device=DEV,
    )  # fmt: skip
    launch = plan_launch(
        torch.device(DEV), num_rows=16, num_seqs=1, num_q_heads=8, num_kv_heads=1,
        max_kv_len=batch[5].shape[1] * 8, max_q_len=16,
    )  # fmt: skip
    assert (launch.rows_per_tile, launch.block_m, launch.num_splits) == (8, 64, 2)
    check_attention(batch, max_q_len=16)


def test_large_split_launch_computes_the_same_attention(tiles):
    # Two sequences of 16 rows x GQA 8 and a padded one: 3 programs (one per sequence) x 2
    # splits fill 6 of the 8 large slots, so 128-vector tiles stay, split, at the split
    # launches' stage count.
    t = tiles(
        max_block_m=128, min_fill_pct_large=75, block_n_large=16, programs_per_sm_large=2,
        min_split_len=16, max_splits=2, num_stages_large=3, num_stages_large_split=2,
    )  # fmt: skip
    batch = ragged_batch(
        [16, 16, 0], [70, 9, 0], num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=8,
        dtype=torch.float32, device=DEV, pad_rows=3,
    )  # fmt: skip
    launch = plan_launch(
        torch.device(DEV), num_rows=35, num_seqs=3, num_q_heads=8, num_kv_heads=1,
        max_kv_len=batch[5].shape[1] * 8, max_q_len=16,
    )  # fmt: skip
    assert (launch.block_m, launch.num_splits) == (128, 2)
    assert launch.num_stages == t.num_stages_large_split
    check_attention(batch, pad_rows=3, max_q_len=16)


def test_sweep_candidates_share_identical_launches(h200):
    by_shape = {shape: bench.rule_candidates(h200, shape) for shape in common.RULE_SHAPES}
    for shape, cands in by_shape.items():
        labels = [c["label"] for c in cands]
        assert labels == [label for label, _ in common.RULE_VARIANTS] + [common.PICKED]
        first = {}
        for c in cands:
            key = str(sorted(c["launch"].items()))
            assert c["same_as"] == first.get(key)  # the first earlier label with this launch
            first.setdefault(key, c["label"])
        picked = cands[-1]["launch"]
        assert (picked["block_m"], picked["num_splits"], picked["num_stages"]) == H200_PICKS[shape]
    # Each rule's pick is one of the candidates it chose between.
    same = {shape: cands[-1]["same_as"] for shape, cands in by_shape.items()}
    assert same[(1, 1024, 16, 8)] == "64 vec 3 st"  # 8 splits of 128 tokens
    assert same[(16, 1024, 16, 8)] == "64 vec 2 st"  # unsplit
    assert same[(16, 2048, 16, 8)] == "64 vec 2 st"
    assert same[(8, 1024, 8, 8)] == "128 vec 2 st"  # 64-vector tiles, 4 splits, 2 stages
    # "min split 512" gives short contexts their old split counts and long ones the same launch
    held = {c["label"]: c for c in by_shape[(1, 1024, 8, 8)]}["64 vec 3 st min split 512"]
    assert held["launch"]["num_splits"] == 2  # against the pick's 8
    held = {c["label"]: c for c in by_shape[(1, 8192, 16, 8)]}["64 vec 3 st min split 512"]
    assert held["same_as"] == "64 vec 3 st"
    assert same[(1, 8192, 16, 8)] == "64 vec 2 st"
    assert same[(16, 8192, 16, 8)] == "128 vec 2 st"
    assert same[(64, 8192, 16, 8)] == "128 vec 3 st"
    assert bench.large_grid_fill_pct(h200, 1, 8192, 16, 8) == pytest.approx(100 * 128 / 264)
    assert bench.large_grid_fill_pct(h200, 16, 8192, 8, 8) == 0.0
    assert bench.large_grid_fill_pct(h200, 16, 1024, 16, 8) == pytest.approx(100 * 128 / 264)
    assert arch.FAMILY_CONFIGS["hopper"].attention.min_fill_pct_large == 50  # restored


def test_sweep_runs_checks_and_reports(tiles, monkeypatch, tmp_path):
    # The sweep's flow on a tiny fp32 pool (the interpreter has no bf16): every distinct launch
    # runs and is checked against SDPA; timings are stand-ins.
    tiles(block_n=16, block_n_large=16, min_split_len=16)
    calls = []

    def fake_time_ms(fn, rep_ms=common.REP_MS):
        fn()
        calls.append(fn)
        return 0.01 * len(calls)

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    device = torch.device(DEV)
    pool = common.KvPool(device, 4 * 48, dtype=torch.float32)
    variants = common.RULE_VARIANTS[1:3]  # 128 vec 3 stages, 64 vec 2 stages
    rec = bench.sweep_rule_shape(pool, (2, 48, 16, 8), 1.0, variants)
    labels = [c["label"] for c in rec["candidates"]]
    assert labels == ["128 vec 3 st", "64 vec 2 st", common.PICKED]
    distinct = [c for c in rec["candidates"] if c["same_as"] is None]
    assert len(calls) == len(distinct) + 1  # and the pick once more
    for c in rec["candidates"]:
        assert c["rel_err"] < 1e-5 and "error" not in c
    assert rec["best"] == "128 vec 3 st"  # the stand-in timings grow call by call
    assert bench.rule_sweep_failures([rec]) == []
    table = bench.rule_sweep_table([rec])
    assert table.count("\n| b2 48 r16 GQA8 |") == 1 + len(distinct)  # summary, launches
    rec["candidates"][0]["rel_err"] = float("nan")
    assert bench.rule_sweep_failures([rec]) == ["b2 48 r16 GQA8 128 vec 3 st"]


def test_parse_shapes():
    assert bench.parse_shapes("") == []
    assert bench.parse_shapes("16x8192x16x8, 1X1024x16x8") == [(16, 8192, 16, 8), (1, 1024, 16, 8)]
    for bad in ("16x8192x16", "16x8190x16x8", "0x1024x1x1"):
        with pytest.raises(ValueError, match="BATCHxCTXxROWSxGQA"):
            bench.parse_shapes(bad)


def test_round_shapes_compile_no_new_attention_variants():
    """A serving round's sequence and row counts change every round: neither may pick a new
    compiled variant (a compile costs seconds inside a round)."""
    from kernels import attention

    assert {attention.seqs_pad(n) for n in range(1, 256)} == {256}
    assert attention.seqs_pad(256) == 512
    kernel = attention._verify_attention_kernel
    # the JIT options (kept as given when the interpreter wraps the kernel)
    options = getattr(kernel, "kwargs", None) or {"do_not_specialize": kernel.do_not_specialize}
    assert {"num_seqs", "num_rows"} <= set(options["do_not_specialize"])


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    num_seqs=st.integers(1, 64),
    extra_rows=st.integers(0, 300),
    max_q_len=st.integers(1, 256),
    kv_pages=st.integers(1, 256),
    gqa=st.sampled_from([(32, 8), (16, 8), (8, 8)]),
)
def test_every_planned_launch_is_a_variant_compiled_ahead(
    h200, num_seqs, extra_rows, max_q_len, kv_pages, gqa
):
    """Whatever round the engine builds (any mix of rows per sequence within the bounds), its
    attention launch is one of the variants `compile_variants` compiles at start-up."""
    from kernels.attention import variant_key

    num_q_heads, num_kv_heads = gqa
    max_kv_len = 4096
    kv_len = min(16 * kv_pages, max_kv_len)
    q_len = min(max_q_len, kv_len)
    num_rows = min(num_seqs - 1 + q_len + extra_rows, num_seqs * q_len)
    num_rows = max(num_rows, num_seqs - 1 + q_len)
    reachable = _reachable(num_q_heads, num_kv_heads, max_kv_len)
    launch = plan_launch(
        torch.device(DEV),
        num_rows=num_rows,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        max_kv_len=kv_len,
        max_q_len=q_len,
    )
    assert variant_key(launch, num_seqs) in reachable, (num_rows, num_seqs, q_len, kv_len)


_REACHABLE: dict = {}


def _reachable(num_q_heads: int, num_kv_heads: int, max_kv_len: int) -> dict:
    from kernels.attention import reachable_variants

    key = (num_q_heads, num_kv_heads, max_kv_len)
    if key not in _REACHABLE:
        _REACHABLE[key] = reachable_variants(
            torch.device(DEV),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            page_size=16,
            max_seqs=64,
            max_q_len=256,
            max_kv_len=max_kv_len,
        )
    return _REACHABLE[key]


def test_compile_variants_runs_each_variant_once_and_leaves_the_cache(h200, monkeypatch):
    from kernels import attention

    runs = []
    real_run = attention._run
    monkeypatch.setattr(
        attention, "_run", lambda *a: runs.append(attention.variant_key(a[-1], 1)) or real_run(*a)
    )
    k = torch.randn(4, 16, 2, 16)
    v = torch.randn(4, 16, 2, 16)
    k_before, v_before = k.clone(), v.clone()
    num = attention.compile_variants(k, v, 4, max_seqs=4, max_q_len=64, max_kv_len=256)
    reachable = attention.reachable_variants(
        torch.device("cpu"),
        num_q_heads=4,
        num_kv_heads=2,
        page_size=16,
        max_seqs=4,
        max_q_len=64,
        max_kv_len=256,
    )
    assert num == len(reachable) == len(runs) == len(set(runs)) > 1
    assert set(runs) == set(reachable)  # (the sequence-search width is 256 for any count here)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_schedule_sweep_variants_all_match_the_reference(h200, monkeypatch):
    """`--sweep --variants schedule`: every 128-vector schedule (planned as on an H200) launches
    and stays exact."""
    monkeypatch.setattr(bench, "time_ms", lambda fn, rep_ms=common.REP_MS: (fn(), 0.01)[1])
    pool = common.KvPool(h200, 4 * 48, dtype=torch.float32)
    rec = bench.sweep_rule_shape(pool, (2, 48, 16, 8), 1.0, common.SCHEDULE_VARIANTS)
    labels = [c["label"] for c in rec["candidates"]]
    assert labels == [label for label, _ in common.SCHEDULE_VARIANTS] + [common.PICKED]
    assert bench.rule_sweep_failures([rec]) == []
    assert {c["launch"]["block_m"] for c in rec["candidates"][:-1]} == {128}
    assert set(common.SWEEP_SETS) == {"rules", "schedule", "m32"}
