"""Cost model: profile interpolation, bucket padding, symmetric confidence-aware calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.cost_calibration import CALIB_ALPHA, CALIB_OUTLIER_RATIO, CALIB_PRIOR_COUNT
from scheduler.cost_model import CostModel, ProfileCost
from scheduler.cost_tables import wide_pass_padded_rows
from tests.scheduler.test_lifecycle_invariants import PROFILE, PROFILES
from tests.scheduler.test_policy_check import MEASURED_1130


def test_profile_points_and_padding():
    # at a profiled point the target cost is the measurement itself
    assert PROFILE.target_ms(128) == pytest.approx(5.1789)
    assert PROFILE.bucket(100) == 128 and PROFILE.bucket(128) == 128
    assert PROFILE.bucket(3000) == 3000  # past the largest bucket: eager, unpadded
    # decode-only rounds pay for their bucket; prefill rounds run eagerly
    assert PROFILE.round_ms(100, 0) == pytest.approx(5.1789)
    assert PROFILE.round_ms(100, 0, num_prefill_rows=50) == pytest.approx(
        float(PROFILE.target_ms(100))
    )
    # linear past the last point, with the last segment's slope
    slope = (43.4554 - 34.8979) / 512
    assert PROFILE.target_ms(2560) == pytest.approx(43.4554 + 512 * slope)


def test_kv_and_drafter_terms():
    kv_ms = 1000 * 147456 / 3.5e12 * 1e3
    assert PROFILE.round_ms(1, 1000) - PROFILE.round_ms(1, 0) == pytest.approx(kv_ms)
    # a chain of depth d over k requests: one step with the catch-up rows, d-1 plain steps
    base = PROFILE.round_ms_scalar(32, 0)
    with_chain = PROFILE.round_ms_scalar(32, 0, draft_depth=3, num_spec=4, drafter_lag_rows=4)
    draft = float(PROFILE.draft_step_ms(8) + 2 * PROFILE.draft_step_ms(4))
    assert with_chain - base == pytest.approx(draft)


@given(
    rows=st.integers(1, 20000),
    kv=st.integers(0, 200000),
    depth=st.integers(0, 7),
    num_spec=st.integers(0, 256),
    lag=st.integers(0, 5000),
    prefill=st.integers(0, 4096),
)
def test_scalar_and_array_paths_agree(rows, kv, depth, num_spec, lag, prefill):
    num_spec = num_spec if depth else 0
    # (the second prices prefill rounds apart, the third proposals by their contexts)
    for profile in (PROFILE, PREFILL_PROFILE, PROFILE_1130_KV):
        a = float(profile.round_ms(rows, kv, depth, num_spec, lag, prefill, True))
        b = profile.round_ms_scalar(rows, kv, depth, num_spec, lag, prefill, True)
        assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize("factor", [0.7, 1.4])
def test_calibration_converges_symmetrically(factor):
    model = CostModel(PROFILE)
    rng = np.random.default_rng(0)
    for _ in range(200):
        raw = model.raw_ms_scalar(64, 10000)
        model.observe(64, False, raw, raw * factor * np.exp(rng.normal(0, 0.03)))
    predicted = model.predict_ms_scalar(64, 10000)
    assert predicted / model.raw_ms_scalar(64, 10000) == pytest.approx(factor, rel=0.03)


def test_unseen_shapes_keep_the_profile_and_get_reprobed():
    model = CostModel(PROFILE)
    # one early round at 512 rows looked 3x slow (a warm-up hiccup)
    raw = model.raw_ms_scalar(512, 0)
    model.observe(512, True, raw, 3 * raw)
    assert model.confidence(512, True) < 0.3  # one observation is not trusted much
    first = model.predict_ms_scalar(512, 0, 7, 64)
    # then many rounds of another shape run exactly as profiled
    for _ in range(400):
        raw = model.raw_ms_scalar(64, 0)
        model.observe(64, False, raw, raw)
    # the hiccup has aged out: the 512-row shape is back near its profile, so it is tried again
    later = model.predict_ms_scalar(512, 0, 7, 64)
    raw_512 = model.raw_ms_scalar(512, 0, 7, 64)
    assert first > 1.05 * raw_512  # (3x counts as CALIB_OUTLIER_RATIO: see below)
    assert later == pytest.approx(raw_512, rel=0.05)
    assert model.confidence(512, True) < 0.1 * CALIB_PRIOR_COUNT


def test_one_outlier_round_moves_the_correction_by_a_bounded_step_a_real_shift_is_followed():
    """One round measured at 19x its price (a stall, an eager short chunk) moves its class's
    correction by at most CALIB_ALPHA x log(CALIB_OUTLIER_RATIO); a lasting change of pace
    is still followed within tens of rounds, up or down."""
    model = CostModel(PROFILE)
    for _ in range(50):
        raw = model.raw_ms_scalar(8, 8000)
        model.observe(8, False, raw, raw)
    before = model.predict_ms_scalar(8, 8000)
    raw = model.raw_ms_scalar(8, 8000)
    model.observe(8, False, raw, 19 * raw)
    after = model.predict_ms_scalar(8, 8000)
    assert before * 1.01 < after <= before * CALIB_OUTLIER_RATIO ** (CALIB_ALPHA + 1e-9)
    # a fresh bucket's first look is bounded the same way around its class (two outliers
    # now: the class correction took two bounded steps)
    raw = model.raw_ms_scalar(256, 8000)
    model.observe(256, False, raw, 30 * raw)
    assert model.predict_ms_scalar(256, 8000) < 1.25 * model.raw_ms_scalar(256, 8000)
    for factor in (1.4, 0.7):
        for _ in range(60):
            raw = model.raw_ms_scalar(8, 8000)
            model.observe(8, False, raw, raw * factor)
        ratio = model.predict_ms_scalar(8, 8000) / model.raw_ms_scalar(8, 8000)
        assert ratio == pytest.approx(factor, rel=0.03)


def _scalar_predictions(model, base_rows, prefill, cells, with_draft_rows):
    """predict_ms_scalar of each planner candidate (draft rows, depth, speculating requests,
    lag rows) on top of `base_rows` rows and 5000 KV tokens, its drafts passed as its draft
    rows or left to the default (depth x requests)."""
    return [
        model.predict_ms_scalar(
            base_rows + extra,
            5000 + extra,
            depth,
            num_spec,
            lag,
            prefill,
            num_draft_rows=extra if with_draft_rows else None,
        )
        for extra, depth, num_spec, lag in cells
    ]


PROFILE_1130 = ProfileCost(MEASURED_1130)
# proposals read the draft KV: 3e-5 ms per draft and context token (a 0.6B-shaped draft model
# on an H200: 28 layers x 8 KV heads x 128 x 2 x 2 bytes per token at ~4 TB/s)
DRAFT_KV_RATE = 3e-5


def with_draft_kv(raw: dict, rate: float = DRAFT_KV_RATE) -> dict:
    """`raw` with `draft_model.kv_ms_per_token` = rate (its context_len kept)."""
    return {**raw, "draft_model": {**raw["draft_model"], "kv_ms_per_token": rate}}


PROFILE_1130_KV = ProfileCost(with_draft_kv(MEASURED_1130))


# candidates of one planned round: (draft rows, depth, speculating requests, lag rows)
PLANNER_CELLS = st.lists(
    st.tuples(st.integers(0, 900), st.integers(1, 7), st.integers(1, 200), st.integers(0, 400)),
    min_size=1,
    max_size=6,
)


@given(
    base_rows=st.integers(1, 3000),
    prefill=st.sampled_from([0, 0, 100, 300]),
    cells=PLANNER_CELLS,
)
def test_planner_grid_matches_predict_ms(base_rows, prefill, cells):
    # (the 2026-11-30 profile measured prompt catch-ups: a following drafter's prefill forward
    # is priced by them, not by its chain steps)
    for profile in (PROFILE, PROFILE_1130, PROFILE_1130_KV):
        model = CostModel(profile, drafter_prefill=True)
        rng = np.random.default_rng(1)
        for rows in (64, 512, 2048):  # give some buckets a correction
            raw = model.raw_ms_scalar(rows, 0)
            model.observe(rows, True, raw, raw * rng.uniform(0.8, 1.2))
        extra, depth, num_spec, lag = (np.array(v) for v in zip(*cells))
        grid = model.predict_spec_grid(base_rows, 5000, extra, depth, num_spec, lag, prefill)
        # (the grid prices each candidate's own draft rows)
        wants = _scalar_predictions(model, base_rows, prefill, cells, with_draft_rows=True)
        for got, want, cell in zip(grid, wants, cells):
            if cell[2] <= base_rows - prefill:  # (its speculating requests decode in the round)
                assert got == pytest.approx(want, rel=1e-9)


def test_single_point_profile_is_flat():
    one = ProfileCost(
        {
            "target": {
                "rows_ms": [[16, 5.0]],
                "kv_bytes_per_token": 0,
                "kv_read_TBps_assumed": 1.0,
            },
            "draft_model": {"rows_ms_per_step": [[1, 1.0]]},
        }
    )
    assert one.round_ms_scalar(100, 0) == pytest.approx(5.0)
    assert float(one.round_ms(5000, 0, 3, 4)) == pytest.approx(8.0)


@given(
    rows=st.integers(1, 20000),
    kv=st.integers(0, 2_000_000),
    depth=st.integers(0, 7),
    num_spec=st.integers(0, 300),
    observed=st.lists(
        st.tuples(st.integers(1, 600), st.booleans(), st.floats(0.5, 2.0)), max_size=8
    ),
)
def test_correcting_a_known_raw_estimate_equals_predict_ms_scalar(
    rows, kv, depth, num_spec, observed
):
    """plan() corrects the raw estimate it already has: predict_ms_scalar's value exactly,
    calibrated or not."""
    cm = CostModel(PROFILE)
    for obs_rows, has_spec, factor in observed:
        raw = cm.raw_ms_scalar(obs_rows, 1000, 3 if has_spec else 0, 8)
        cm.observe(obs_rows, has_spec, raw, raw * factor)
    raw = cm.raw_ms_scalar(rows, kv, depth, num_spec, 3, 0)
    assert cm.correct_ms_scalar(raw, rows, depth > 0) == cm.predict_ms_scalar(
        rows, kv, depth, num_spec, 3, 0
    )


@given(
    rows=st.integers(1, 600),
    kv=st.integers(0, 200_000),
    depth=st.integers(0, 4),
    prefill=st.sampled_from([0, 64]),
)
def test_rounds_ahead_scale_only_ar_decode_rounds(rows, kv, depth, prefill):
    """The profile's `ar_ahead_ratio` prices AR-only decode rounds (they run ahead, the host's
    work hidden) and nothing else; scalar and array paths agree."""
    import json
    from pathlib import Path

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw["target"]["ar_ahead_ratio"] = [[1, 0.8], [64, 0.9], [256, 0.95]]
    ahead = ProfileCost(raw)
    num_spec = min(rows, 4) if depth else 0
    args = (rows, kv, depth, num_spec, 0, prefill)
    scale = 1.0
    if depth == 0 and prefill == 0:
        scale = float(np.interp(rows, [1, 64, 256], [0.8, 0.9, 0.95]))
    want = PROFILE.round_ms_scalar(*args) * scale
    assert ahead.round_ms_scalar(*args) == pytest.approx(want, rel=1e-9)
    assert float(ahead.round_ms(*args)) == pytest.approx(want, rel=1e-9)


def _two_requests_on_the_simulator(profile: ProfileCost, cm: CostModel, spec_mode, max_tokens):
    """A 2-slot scheduler (the given mode, a drafter) with two 20-token requests waiting, and a
    noiseless simulated executor on the code cohort."""
    from scheduler.plan import SamplingSpec
    from scheduler.request import RequestSpec
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from scheduler.sim.executor import SimExecutor
    from tests.scheduler.test_lifecycle_invariants import COHORTS

    cfg = SchedulerConfig(
        max_concurrency=2,
        spec_mode=spec_mode,
        block_size=4,
        max_prefill_tokens=64,
        has_drafter=True,
    )
    sched = Scheduler(cfg, num_kv_blocks=128, cost_model=cm)
    for i in range(2):
        spec = RequestSpec(
            req_id=i,
            prompt_token_ids=tuple(range(10, 30)),
            sampling=SamplingSpec(),
            max_tokens=max_tokens,
        )
        sched.add_request(spec)
    return sched, SimExecutor(profile, COHORTS["code"], 2, seed=0, noise_sigma=0.0)


@pytest.mark.parametrize("overlapped", [True, False])
def test_calibration_compares_ar_rounds_with_their_own_price(overlapped):
    """An AR round that ran ahead costs its period (the profile's ahead ratio); one that did not
    (the next round was speculative) costs the round alone. Measured at exactly those prices,
    the AR correction stays 1 either way: it calibrates the model, not the overlap."""
    import json
    from pathlib import Path

    import msgspec

    path = Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json"
    raw = json.loads(path.read_text())
    raw["target"]["ar_ahead_ratio"] = [[1, 0.8], [512, 0.8]]
    profile = ProfileCost(raw)
    cm = CostModel(profile)
    sched, ex = _two_requests_on_the_simulator(profile, cm, "ar", max_tokens=30)
    num_ar = 0
    while sched.has_work():
        plan = sched.plan(0.0)
        result = ex.run(plan)
        if plan.is_decode_only and not plan.decode.num_draft.any():
            num_ar += 1
            assert result.overlapped  # the simulator's AR rounds run ahead
            if not overlapped:  # priced and measured as a round alone
                timings = msgspec.structs.replace(
                    result.timings, total_ms=result.timings.total_ms / 0.8
                )
                result = msgspec.structs.replace(result, timings=timings, overlapped=False)
        sched.update(result, 0.0)
    assert num_ar > 10
    assert float(cm.correction(2, False)) == pytest.approx(1.0, abs=1e-6)


def _profile_with_spec_host(points) -> ProfileCost:
    import json
    from pathlib import Path

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw["target"]["spec_host_ms_per_round"] = points
    return ProfileCost(raw)


@given(
    rows=st.integers(1, 3000),
    kv=st.integers(0, 200_000),
    depth=st.integers(0, 7),
    num_spec=st.integers(0, 64),
    prefill=st.sampled_from([0, 64]),
)
def test_speculating_rounds_carry_the_engines_host_time(rows, kv, depth, num_spec, prefill):
    """`spec_host_ms_per_round` (by decoding requests) adds to speculating rounds only, the
    same on the scalar and array paths."""
    host = _profile_with_spec_host([[1, 1.0], [16, 2.0], [64, 3.0]])
    num_spec = min(num_spec, rows) if depth else 0
    args = (rows, kv, depth, num_spec, 2, prefill)
    extra = 0.0
    if depth:
        seqs = max(rows - prefill - num_spec * depth, num_spec)
        extra = float(np.interp(min(seqs, 4095), [1, 16, 64], [1.0, 2.0, 3.0]))
        assert host.round_spec_host_ms(rows, prefill, num_spec, depth) == pytest.approx(extra)
    want = PROFILE.round_ms_scalar(*args) + extra
    assert host.round_ms_scalar(*args) == pytest.approx(want, rel=1e-9)
    assert float(host.round_ms(*args)) == pytest.approx(want, rel=1e-9)


def test_planner_grid_and_predict_agree_with_spec_host_time():
    """The planner prices the host time by the round's decoding requests; `round_ms` infers
    them from its rows, exactly when every speculating request drafts the same depth."""
    model = CostModel(_profile_with_spec_host([[1, 1.5], [128, 2.5]]))
    depth, num_spec, lag = np.array([1, 4, 6]), np.array([1, 2, 8]), np.array([0, 3, 0])
    extra = num_spec * depth
    grid = model.predict_spec_grid(32, 4000, extra, depth, num_spec, lag, 0)
    for i in range(3):
        want = model.predict_ms_scalar(
            32 + int(extra[i]), 4000 + int(extra[i]), int(depth[i]), int(num_spec[i]), int(lag[i])
        )
        assert grid[i] == pytest.approx(want, rel=1e-9)
    fixed = model.spec_row_terms(32, 4000, 40, 0)[1]
    no_host = CostModel(PROFILE).spec_row_terms(32, 4000, 40, 0)[1]
    assert fixed - no_host == pytest.approx(np.full(41, np.interp(32, [1, 128], [1.5, 2.5])))


def test_calibration_leaves_the_engines_host_time_out():
    """The simulated executor reports its own time (the engine's host time is the runner's):
    measured at exactly the profile's price, the speculating correction stays 1, while the
    simulated clock advances by the whole period."""

    profile = _profile_with_spec_host([[1, 2.0], [8, 4.0]])
    cm = CostModel(profile)
    sched, ex = _two_requests_on_the_simulator(profile, cm, "spec", max_tokens=60)
    num_spec_rounds = 0
    while sched.has_work():
        plan = sched.plan(0.0)
        result = ex.run(plan)
        if plan.decode.num_draft.any():
            num_spec_rounds += 1
            assert ex.last_host_ms == pytest.approx(2.0 + 2.0 * (len(plan.decode.req_ids) - 1) / 7)
            assert plan.predicted_ms == pytest.approx(result.timings.total_ms + ex.last_host_ms)
        sched.update(result, 0.0)
    assert num_spec_rounds > 5
    assert float(cm.correction(8, True)) == pytest.approx(1.0, abs=1e-6)


def _profile_with_catchup_passes(per_pass: int, max_passes: int) -> ProfileCost:
    import json
    from pathlib import Path

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw["draft_model"].update(catchup_rows_per_pass=per_pass, max_catchup_passes=max_passes)
    return ProfileCost(raw)


def test_a_graphed_drafter_pays_one_step_per_catch_up_pass():
    passes = _profile_with_catchup_passes(4, 8)
    step = PROFILE.draft_step_ms
    # no catch-up: one step over the speculating requests, as without passes
    assert float(passes.first_step_ms(3, 0)) == pytest.approx(float(step(3)))
    # 2 requests, 10 catch-up rows: 6 rows each, two passes of 6 rows in all
    assert float(passes.first_step_ms(2, 10)) == pytest.approx(2 * float(step(6)))
    # more than 8 passes: one forward of every row
    assert float(passes.first_step_ms(1, 40)) == pytest.approx(float(step(41)))
    # a profile without passes prices every catch-up as one forward
    assert float(PROFILE.first_step_ms(2, 10)) == pytest.approx(float(step(12)))


@given(
    rows=st.integers(1, 3000),
    kv=st.integers(0, 200_000),
    depth=st.integers(1, 7),
    num_spec=st.integers(1, 64),
    lag=st.integers(0, 400),
)
def test_catch_up_passes_price_alike_on_every_path(rows, kv, depth, num_spec, lag):
    passes = _profile_with_catchup_passes(4, 8)
    model = CostModel(passes)
    a = float(passes.round_ms(rows, kv, depth, num_spec, lag))
    b = passes.round_ms_scalar(rows, kv, depth, num_spec, lag)
    assert a == pytest.approx(b, rel=1e-9)
    grid = model.predict_spec_grid(
        rows, kv, np.array([0]), np.array([depth]), np.array([num_spec]), np.array([lag]), 0
    )
    assert grid[0] == pytest.approx(model.predict_ms_scalar(rows, kv, depth, num_spec, lag))


def test_catch_ups_past_the_step_curve_use_the_measured_prompt_catch_up():
    import json
    from pathlib import Path

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    steps = raw["draft_model"]["rows_ms_per_step"]
    raw["draft_model"]["catchup_rows_ms"] = [[128, 99.0], [1024, 14.0], [2048, 20.0]]
    prof = ProfileCost(raw)
    # the chain steps keep their own points (a catch-up point inside their range is ignored)
    for rows, ms in steps:
        assert float(prof.draft_step_ms(rows)) == pytest.approx(ms)
    assert float(prof.draft_step_ms(1024)) == pytest.approx(14.0)
    assert float(prof.draft_step_ms(1536)) == pytest.approx(17.0)
    assert float(prof.first_step_ms(1, 1023)) == pytest.approx(14.0)


def test_wide_catch_ups_are_priced_at_their_padded_passes():
    """A graphed drafter's long catch-up runs in passes of 2048 rows (all but the last full),
    the last padded to its wide bucket: priced so on every path."""
    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    d = raw["draft_model"]
    d["catchup_rows_ms"] = [[64, 2.0], [1024, 4.0], [2048, 6.0], [4096, 11.0]]
    d["catchup_rows_per_pass"], d["max_catchup_passes"] = 4, 1
    flat = ProfileCost(raw)
    d["catchup_pass_rows"], d["catchup_pass_buckets"] = 2048, [64, 1024, 1536, 2048]
    padded = ProfileCost(raw)
    # 1100 rows of one request: one pass at the 1536 bucket (5.0 ms), not at 1100 rows
    assert float(padded.first_step_ms(1, 1099)) == pytest.approx(5.0)
    assert float(flat.first_step_ms(1, 1099)) == pytest.approx(4.0 + 76 / 1024 * 2.0)
    # 2100 rows: a full pass (what a second one adds: 11 - 6 ms) and 52 rows padded to 64
    want = 5.0 + 2.0
    assert float(padded.first_step_ms(2, 2098)) == pytest.approx(want)
    assert padded.first_step_ms_scalar(2, 2098) == pytest.approx(want)
    assert padded.follow_ms(2100) == pytest.approx(want)
    # whole buckets and full passes cost their measurements
    for rows, ms in ([1024, 4.0], [2048, 6.0], [4096, 11.0]):
        assert float(padded.first_step_ms(1, rows - 1)) == pytest.approx(ms)
    # never below the unpadded price
    rows = np.arange(1, 6000)
    assert np.all(padded.first_step_ms(1, rows) >= flat.first_step_ms(1, rows) - 1e-9)


@pytest.mark.parametrize(
    "rows,want", [(0, 0), (1, 64), (64, 64), (65, 1024), (1100, 1536), (2048, 2048), (2049, 2112)]
)
def test_wide_pass_padded_rows(rows, want):
    buckets = np.array([64, 1024, 1536, 2048])
    assert int(wide_pass_padded_rows(np.array([rows]), 2048, buckets)[0]) == want


def test_timing_noise_does_not_spread_the_speculating_buckets_apart():
    """Many speculating shapes, each measured a few times with 10% noise around the profile's
    price: their corrections stay within a few per cent of each other, so the planner's pick
    among them is not won by the luckiest measurement."""
    model = CostModel(PROFILE)
    rng = np.random.default_rng(3)
    rows = [16, 24, 32, 48, 64, 80, 96, 112, 128, 160]
    for _ in range(300):
        n = int(rng.choice(rows))
        raw = model.raw_ms_scalar(n, 4000, 3, 8)
        model.observe(n, True, raw, raw * float(np.exp(rng.normal(0, 0.1))))
    corr = [float(model.correction(n, True)) for n in rows]
    assert max(corr) / min(corr) < 1.06
    assert all(abs(c - 1) < 0.05 for c in corr)


def test_a_model_free_drafters_host_time_prices_speculating_rounds():
    import json
    from pathlib import Path

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw.pop("draft_model")
    raw["drafter_host"] = {"name": "ngram", "propose_ms": [[1, 0.1], [64, 2.0]]}
    lookup = ProfileCost(raw)
    raw.pop("drafter_host")
    none = ProfileCost(raw)
    extra = float(np.interp(8, [1, 64], [0.1, 2.0]))
    assert lookup.round_ms_scalar(72, 8000, 8, 8) - none.round_ms_scalar(72, 8000, 8, 8) == (
        pytest.approx(extra)
    )
    assert float(lookup.round_ms(72, 8000, 8, 8)) == pytest.approx(
        lookup.round_ms_scalar(72, 8000, 8, 8)
    )
    assert lookup.round_ms_scalar(8, 8000) == none.round_ms_scalar(8, 8000)  # AR: nothing
    model = CostModel(lookup)
    grid = model.predict_spec_grid(
        8, 8000, np.array([64]), np.array([8]), np.array([8]), np.array([0]), 0
    )
    assert grid[0] == pytest.approx(model.predict_ms_scalar(72, 8064, 8, 8))


def test_the_planner_does_not_speculate_when_the_lookup_costs_more_than_it_gains():
    import json
    from pathlib import Path

    from scheduler.depth_planner import plan_depths

    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw.pop("draft_model")
    choices = {}
    for name, ms in (("cheap", 0.01), ("dear", 50.0)):
        raw["drafter_host"] = {"name": "ngram", "propose_ms": [[1, ms], [64, ms]]}
        model = CostModel(ProfileCost(raw))
        survival = np.full((4, 7), 0.9)  # [n, D]
        choice = plan_depths(
            survival, survival.copy(), np.ones(4), np.zeros(4), model, 4, 4000, 4.0, 0
        )
        choices[name] = int(choice.num_draft.sum())
    assert choices["cheap"] > 0 and choices["dear"] == 0


def test_proposals_are_priced_at_the_batchs_context():
    """A speculating round's drafts read their requests' draft KV: past the proposal's
    reference context each draft costs kv_ms_per_token per token of the batch's mean context
    more (less below it); without the rate the drafter's price ignores the context."""
    ref = MEASURED_1130["draft_model"]["context_len"]
    k, drafts = 16, 7

    def spec_round(profile, context):  # 16 requests drafting 7 each, contexts of `context`
        rows = k * (1 + drafts)
        kv = k * context + rows
        return profile.round_ms_scalar(rows, kv, drafts, k, num_draft_rows=k * drafts)

    def target_kv(context):  # the target's own KV term, on both profiles
        return k * context * PROFILE_1130.kv_ms_per_token

    for context in (256, 4096, 16384):
        grown = spec_round(PROFILE_1130_KV, context) - spec_round(PROFILE_1130_KV, ref)
        plain = spec_round(PROFILE_1130, context) - spec_round(PROFILE_1130, ref)
        assert plain == pytest.approx(target_kv(context) - target_kv(ref), rel=1e-9)
        ratio = PROFILE_1130.spec_ratio_scalar(k)
        drafter = DRAFT_KV_RATE * k * drafts * (context - ref) * ratio
        assert grown - plain == pytest.approx(drafter, rel=1e-9)
    # an AR round does not draft
    assert PROFILE_1130_KV.round_ms_scalar(16, 16 * 4096) == PROFILE_1130.round_ms_scalar(
        16, 16 * 4096
    )


def test_the_planner_drafts_less_where_long_contexts_make_proposals_dear():
    from scheduler.depth_planner import plan_depths

    n = 16
    survival = np.cumprod(np.full((n, 7), 0.8), axis=1)  # [n, D]

    def drafts(profile, context):
        choice = plan_depths(
            survival,
            survival.copy(),
            np.ones(n),
            np.zeros(n),
            CostModel(profile),
            n,
            n * (context + 1),
            float(n),
            0,
        )
        return int(choice.num_draft.sum())

    ref = MEASURED_1130["draft_model"]["context_len"]
    at_ref = drafts(PROFILE_1130_KV, ref)
    assert at_ref == drafts(PROFILE_1130, ref) > 0  # at the reference context: the same
    # at 16k tokens each of 16 requests' drafts read 4 GB of draft KV more than at 1k (~1 ms
    # per draft); priced at the reference context, the plan would not change
    assert drafts(PROFILE_1130, 16384) >= at_ref
    assert drafts(PROFILE_1130_KV, 16384) < at_ref


# -- speculating rounds as served: spec_rows_ms and propose_ms -------------------------------
SPEC_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)


# a monotone target curve (the shared profile's, as measured, dips at 16 rows, so its excess
# over the AR curve would be clamped where it dips)
MONO_ROWS = [[r, 4.4 + 0.02 * r] for r in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)]


def _raw_profile(monotone: bool = True) -> dict:
    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    if monotone:
        raw["target"]["rows_ms"] = MONO_ROWS
    return raw


def _with_spec_tables(raw: dict, target_scale=1.15, chain_scale=1.3, noise=0.0) -> dict:
    """`raw` plus both tables: the target's a multiple of the AR curve at the same rows, the
    proposal's a multiple of about d chain steps (noise: a seeded relative jitter, so the tables
    are not monotone as measured)."""
    old = ProfileCost(raw)
    rng = np.random.default_rng(3)
    spec_rows = []
    for k in SPEC_COUNTS:
        for r in (2, 4, 8):
            jitter = 1.0 + noise * rng.uniform(-1, 1)
            spec_rows.append([k, r, float(old.target_ms(k * r)) * target_scale * jitter])
    propose = []
    for k in SPEC_COUNTS:
        for d in (1, 3, 7):
            jitter = 1.0 + noise * rng.uniform(-1, 1)
            # (a monotone stand-in for d chain steps: the shared profile's step curve dips)
            propose.append([k, d, (0.3 + d * (0.9 + 0.005 * k)) * chain_scale * jitter])
    out = json.loads(json.dumps(raw))
    out["target"]["spec_rows_ms"] = spec_rows
    out["draft_model"]["propose_ms"] = propose
    return out


TABLES = ProfileCost(_with_spec_tables(_raw_profile()))
# noisy tables, and speculating rounds as the engine pays them 10-40% above their terms
_NOISY_RAW = _with_spec_tables(_raw_profile(), noise=0.2)
_NOISY_RAW["target"]["spec_round_ratio"] = [[1, 1.1], [8, 1.25], [64, 1.4]]
NOISY = ProfileCost(_NOISY_RAW)
NOISY_KV = ProfileCost(with_draft_kv(_NOISY_RAW))


def test_a_profiled_speculating_round_costs_its_measurements():
    raw = _with_spec_tables(_raw_profile())
    spec_rows = {(k, r): ms for k, r, ms in raw["target"]["spec_rows_ms"]}
    propose = {(k, d): ms for k, d, ms in raw["draft_model"]["propose_ms"]}
    for k in (2, 4, 16, 128):  # k * r a row bucket of the profile
        for r in (2, 4, 8):
            if k * r not in TABLES.row_buckets:
                continue
            d = r - 1
            price = TABLES.round_ms_scalar(k * r, 0, d, k)
            assert price == pytest.approx(spec_rows[(k, r)] + propose[(k, d)], rel=1e-9)
            assert float(TABLES.round_ms(k * r, 0, d, k)) == pytest.approx(price, rel=1e-9)


def test_between_profiled_counts_interpolation_is_log_linear_in_requests():
    w = (np.log(6) - np.log(4)) / (np.log(8) - np.log(4))
    want = (1 - w) * TABLES.chain_ms_scalar(4, 3) + w * TABLES.chain_ms_scalar(8, 3)
    assert TABLES.chain_ms_scalar(6, 3) == pytest.approx(want, rel=1e-9)
    # drafts between the profiled 3 and 7: linear
    want = 0.5 * (TABLES.chain_ms_scalar(8, 3) + TABLES.chain_ms_scalar(8, 7))
    assert TABLES.chain_ms_scalar(8, 5) == pytest.approx(want, rel=1e-9)
    # 6 rows per group between the profiled 4 and 8: the excess halfway
    half = 0.5 * (TABLES.spec_excess_ms_scalar(8, 24) + TABLES.spec_excess_ms_scalar(8, 56))
    assert TABLES.spec_excess_ms_scalar(8, 40) == pytest.approx(half, rel=1e-9)
    assert TABLES.spec_excess_ms_scalar(8, 0) == 0.0  # AR rows: no excess


@given(
    rows=st.integers(1, 5000),
    kv=st.integers(0, 200_000),
    depth=st.integers(0, 7),
    num_spec=st.integers(0, 300),
    lag=st.integers(0, 500),
    prefill=st.sampled_from([0, 0, 300]),
)
def test_old_profiles_keep_todays_prices_exactly(rows, kv, depth, num_spec, lag, prefill):
    """Empty tables are no tables: every price is bit for bit the profile's without them."""
    old, new = _OLD, _EMPTY
    assert not new.has_spec_tables
    num_spec = num_spec if depth else 0
    args = (rows, kv, depth, num_spec, lag, prefill, True)
    assert new.round_ms_scalar(*args) == old.round_ms_scalar(*args)
    assert float(new.round_ms(*args)) == float(old.round_ms(*args))


def _empty_tables() -> ProfileCost:
    raw = _raw_profile(monotone=False)
    raw["target"]["spec_rows_ms"] = []
    raw["draft_model"]["propose_ms"] = []
    return ProfileCost(raw)


_OLD = ProfileCost(_raw_profile(monotone=False))
_EMPTY = _empty_tables()


@given(
    rows=st.integers(1, 5000),
    kv=st.integers(0, 200_000),
    depth=st.integers(0, 9),
    num_spec=st.integers(0, 1500),
    drafts=st.integers(0, 3000),
    lag=st.integers(0, 500),
    prefill=st.sampled_from([0, 0, 300]),
    noisy=st.booleans(),
)
def test_spec_tables_price_alike_on_every_path(
    rows, kv, depth, num_spec, drafts, lag, prefill, noisy
):
    prof = NOISY if noisy else TABLES
    num_spec = num_spec if depth else 0
    a = float(prof.round_ms(rows, kv, depth, num_spec, lag, prefill, True, drafts))
    b = prof.round_ms_scalar(rows, kv, depth, num_spec, lag, prefill, True, num_draft_rows=drafts)
    assert a == pytest.approx(b, rel=1e-9)
    assert float(prof.chain_ms(num_spec, depth)) == pytest.approx(
        prof.chain_ms_scalar(num_spec, depth), rel=1e-9
    )


@given(
    base_rows=st.integers(1, 2000),
    prefill=st.sampled_from([0, 0, 300]),
    cells=PLANNER_CELLS,
)
def test_planner_terms_with_spec_tables_match_predict_ms(base_rows, prefill, cells):
    for prof in (NOISY, NOISY_KV):
        model = CostModel(prof, drafter_prefill=True)
        for rows in (64, 512):  # give some buckets a correction
            raw = model.raw_ms_scalar(rows, 0, 3, 8)
            model.observe(rows, True, raw, raw * 1.1)
        extra, depth, num_spec, lag = (np.array(v) for v in zip(*cells))
        grid = model.predict_spec_grid(base_rows, 5000, extra, depth, num_spec, lag, prefill)
        corr, fixed = model.spec_row_terms(base_rows, 5000, int(extra.max()), prefill)
        terms = prof.spec_terms_ms(num_spec, extra, depth) + prof.catchup_extra_ms(num_spec, lag)
        wants = _scalar_predictions(model, base_rows, prefill, cells, with_draft_rows=True)
        for i, want in enumerate(wants):
            if num_spec[i] > base_rows - prefill:  # (its speculating requests decode in it)
                continue
            assert grid[i] == pytest.approx(want, rel=1e-9)
            ratio = prof.spec_ratio_scalar(int(num_spec[i]))
            planner = corr[extra[i]] * (fixed[extra[i]] + terms[i]) * ratio
            assert planner == pytest.approx(want, rel=1e-9)


@given(
    num_spec=st.integers(1, 300),
    depth=st.integers(1, 7),
    num_ar=st.integers(0, 200),
    kv=st.integers(0, 100_000),
)
def test_spec_prices_are_monotone_in_rows(num_spec, depth, num_ar, kv):
    """More draft rows for the same speculating requests, or more AR rows beside them, never
    price a round lower (the tables measured with noise are made monotone); a deeper chain or
    more requests never cost the drafter less."""
    prof = NOISY
    prev = 0.0
    for drafts in range(0, num_spec * depth + 1, max(1, num_spec * depth // 40)):
        rows = num_ar + num_spec + drafts
        price = prof.round_ms_scalar(rows, kv, depth, num_spec, num_draft_rows=drafts)
        assert price >= prev - 1e-9
        prev = price
        more_ar = prof.round_ms_scalar(rows + 5, kv, depth, num_spec, num_draft_rows=drafts)
        assert more_ar >= price - 1e-9
    assert prof.chain_ms_scalar(num_spec, depth + 1) >= prof.chain_ms_scalar(num_spec, depth)
    assert prof.chain_ms_scalar(num_spec + 1, depth) >= prof.chain_ms_scalar(num_spec, depth)


def test_catch_ups_keep_their_pass_pricing_on_top_of_the_proposal():
    raw = _with_spec_tables(_raw_profile())
    raw["draft_model"].update(catchup_rows_per_pass=4, max_catchup_passes=8)
    prof = ProfileCost(raw)
    for k, lag in ((2, 10), (8, 8), (1, 40)):
        added = prof.round_ms_scalar(64, 0, 3, k, lag) - prof.round_ms_scalar(64, 0, 3, k, 0)
        want = float(prof.first_step_ms(k, lag) - prof.draft_step_ms(k))
        assert added == pytest.approx(want, rel=1e-9)
        assert float(prof.round_ms(64, 0, 3, k, lag)) == pytest.approx(
            prof.round_ms_scalar(64, 0, 3, k, lag), rel=1e-9
        )


def test_the_simulator_prices_all_spec_from_the_tables():
    """The simulator's rounds go through the same cost model: dearer speculating rounds as
    served make all-spec slower there, AR untouched."""
    from scheduler.sim.acceptance_model import load_cohorts
    from scheduler.sim.runner import SimSetup, Workload, run_sim

    cohort = load_cohorts(PROFILES / "acceptance.json")["prose"]
    work = Workload(num_requests=8, prompt_len=256, max_tokens=48)
    old = ProfileCost(_raw_profile())
    out = {}
    for name, prof in (("old", old), ("tables", TABLES)):
        for policy in ("all-spec", "all-ar"):
            res = run_sim(prof, cohort, SimSetup(policy=policy, concurrency=8, seed=1), work)
            out[name, policy] = res.refill_tok_s
    assert out["tables", "all-ar"] == pytest.approx(out["old", "all-ar"], rel=1e-9)
    assert out["tables", "all-spec"] < 0.9 * out["old", "all-spec"]


@given(
    firsts=st.lists(st.booleans(), min_size=1, max_size=300),
    keep=st.lists(st.booleans(), min_size=300, max_size=300),
    depth=st.integers(1, 9),
    which=st.sampled_from(["tables", "noisy", "old", "lookup"]),
    big=st.booleans(),
)
def test_the_planners_spec_terms_equal_the_array_terms(firsts, keep, depth, which, big):
    """SpecTerms (the planner's per-cap form: lookups by request count done once) gives
    spec_terms_ms of every prefix subset, also past the tables' request counts."""
    prof = {"tables": TABLES, "noisy": NOISY, "old": _OLD, "lookup": _LOOKUP}[which]
    num_spec = np.cumsum(np.array(firsts)) + (1100 if big else 0)  # [P] prefixes' requests
    num_spec = np.maximum(num_spec, 1)
    terms = prof.spec_terms(num_spec)
    taken = np.flatnonzero(np.array(keep[: len(num_spec)]))  # a cap's subset of the prefixes
    rows = np.arange(1, len(taken) + 1)
    want = prof.spec_terms_ms(num_spec[taken], rows, depth)
    np.testing.assert_allclose(terms(taken, rows, depth), want, rtol=1e-9)


def _lookup_with_tables() -> ProfileCost:
    raw = _with_spec_tables(_raw_profile())
    raw.pop("draft_model")
    raw["drafter_host"] = {"name": "ngram", "propose_ms": [[1, 0.1], [64, 2.0]]}
    return ProfileCost(raw)


_LOOKUP = _lookup_with_tables()


def test_speculating_rounds_share_one_correction_that_ar_rounds_do_not_dilute():
    """Speculating rounds 30% dearer than profiled move every speculating shape (also one never
    run) to about 1.3x while AR rounds, run as profiled in between, keep theirs at 1; the
    speculating class drifts back once it stops running."""
    model = CostModel(PROFILE)
    for _ in range(40):
        raw = model.raw_ms_scalar(64, 0, 7, 8)
        model.observe(64, True, raw, 1.3 * raw)
        raw = model.raw_ms_scalar(8, 0)
        model.observe(8, False, raw, raw)
    unseen = model.predict_ms_scalar(256, 0, 7, 32) / model.raw_ms_scalar(256, 0, 7, 32)
    assert unseen == pytest.approx(1.3, rel=0.03)
    assert model.predict_ms_scalar(16, 0) == pytest.approx(model.raw_ms_scalar(16, 0), rel=0.01)
    for _ in range(1000):  # AR only from here on
        raw = model.raw_ms_scalar(8, 0)
        model.observe(8, False, raw, raw)
    again = model.predict_ms_scalar(256, 0, 7, 32) / model.raw_ms_scalar(256, 0, 7, 32)
    assert again == pytest.approx(1.0, abs=0.01)


def test_prefill_rounds_calibrate_their_own_class_not_the_ar_decode_rounds():
    """A run starts with prefill rounds measured 20% above the profile and no AR decode round
    yet: the all-AR alternative of the decode batch keeps the profile's price, a prefill round
    is predicted at 1.2x, and a prefill round with drafts too (scalar and array paths)."""
    model = CostModel(PROFILE)
    for _ in range(25):
        raw = model.raw_ms_scalar(2048, 20000, 0, 0, 0, 2000)
        model.observe(2048, False, raw, 1.2 * raw, has_prefill=True)
    assert model.predict_ms_scalar(32, 32000) == pytest.approx(model.raw_ms_scalar(32, 32000))
    spec = model.predict_ms_scalar(256, 32000, 7, 32) / model.raw_ms_scalar(256, 32000, 7, 32)
    assert spec == pytest.approx(1.0)
    for depth, num_spec in ((0, 0), (3, 4)):
        raw = model.raw_ms_scalar(1500, 20000, depth, num_spec, 0, 1400)
        got = model.predict_ms_scalar(1500, 20000, depth, num_spec, 0, 1400)
        assert got / raw == pytest.approx(1.2, rel=0.03)
    arr = model.predict_ms(np.array([32, 1500]), np.array([32000, 20000]), 0, 0, 0, [0, 1400])
    assert arr[0] == pytest.approx(model.raw_ms_scalar(32, 32000))
    assert arr[1] / model.raw_ms_scalar(1500, 20000, 0, 0, 0, 1400) == pytest.approx(1.2, rel=0.03)


@given(
    rows=st.integers(1, 1500),
    depth=st.integers(0, 7),
    num_spec=st.integers(1, 128),
    prefill=st.sampled_from([0, 300]),
)
def test_the_executors_part_is_the_round_less_the_engines_host_time(rows, depth, num_spec, prefill):
    num_spec = num_spec if depth else 0
    for prof in (TABLES, NOISY):
        whole = prof.round_ms_scalar(rows, 4000, depth, num_spec, 0, prefill)
        host = prof.round_spec_host_ms(rows, prefill, num_spec, depth) if depth else 0.0
        part = prof.round_ms_scalar(rows, 4000, depth, num_spec, 0, prefill, executor_only=True)
        assert part == pytest.approx(whole - host, rel=1e-12, abs=1e-12)


def test_a_following_drafter_prices_prefill_chunks_as_one_wide_forward():
    """With the draft model following prefill chunks, a round with chunk rows pays the draft
    model's wide forward over them: the catch-up curve, not the chain step's (a step of that
    many requests at the reference context)."""
    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw["draft_model"]["catchup_rows_ms"] = [[64, 2.0], [256, 2.5], [1024, 3.9]]
    prof = ProfileCost(raw)
    for rows in (64, 100, 1024):
        extra = prof.round_ms_scalar(
            rows, 0, num_prefill_rows=rows, drafter_prefill=True
        ) - prof.round_ms_scalar(rows, 0, num_prefill_rows=rows)
        assert extra == pytest.approx(float(np.interp(rows, [64, 256, 1024], [2.0, 2.5, 3.9])))
        one = np.array([rows])
        grid = prof.round_ms(one, 0, num_prefill_rows=one, drafter_prefill=True)
        assert float(grid[0] - prof.round_ms(one, 0, num_prefill_rows=one)[0]) == pytest.approx(
            extra
        )


def _with_prefill_rounds() -> ProfileCost:
    raw = json.loads((PROFILES / "h200-qwen3-8b.json").read_text())
    raw["target"]["prefill_rows_ms"] = [[256, 9.0], [1024, 27.0], [2048, 51.0]]
    return ProfileCost(raw)


PREFILL_PROFILE = _with_prefill_rounds()


def test_rounds_with_prefill_chunks_are_priced_by_the_profiled_prefill_rounds():
    cost = PREFILL_PROFILE
    # the profiled chunk rounds themselves, linear between them and past the last one
    assert cost.round_ms_scalar(2048, 0, num_prefill_rows=2048) == pytest.approx(51.0)
    assert cost.round_ms_scalar(1536, 0, num_prefill_rows=1536) == pytest.approx(39.0)
    assert cost.round_ms_scalar(3072, 0, num_prefill_rows=3072) == pytest.approx(75.0)
    # below the fewest prefill rows: flat (an eager round costs its launches, whatever its rows)
    for rows in (1, 16, 100, 256):
        assert float(cost.prefill_target_ms(rows)) == pytest.approx(9.0)
    assert cost.round_ms_scalar(16, 0, num_prefill_rows=9) == pytest.approx(9.0)
    assert cost.round_ms_scalar(16, 0, num_prefill_rows=9) > 1.9 * PROFILE.round_ms_scalar(16, 0)
    for rows, kv, depth, num_spec in ((1, 0, 0, 0), (40, 9000, 0, 0), (64, 60000, 7, 8)):
        # decode-only rounds keep the graphed decode curve
        assert cost.round_ms_scalar(rows, kv, depth, num_spec) == pytest.approx(
            PROFILE.round_ms_scalar(rows, kv, depth, num_spec)
        )
        # the planner's grid: one more request drafting one token next to a chunk
        model = CostModel(cost)
        one = np.ones(1, dtype=np.int64)
        base = rows + 700
        grid = model.predict_spec_grid(base, kv, one, one, one, one * 0, 700)
        want = model.predict_ms_scalar(base + 1, kv + 1, 1, 1, 0, 700, num_draft_rows=1)
        assert grid[0] == pytest.approx(want)
