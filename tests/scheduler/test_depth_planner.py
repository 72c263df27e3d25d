"""The depth planner against brute force on small batches, and its constraints."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.depth_planner import FORCE_KEY, plan_depths
from tests.scheduler.test_cost_model import NOISY
from tests.scheduler.test_lifecycle_invariants import PROFILE

MODEL = CostModel(PROFILE)


def objective(num_draft, survival, weights, base_rows, base_kv, base_tokens, bar):
    tokens = base_tokens + sum(w * s[:d].sum() for d, s, w in zip(num_draft, survival, weights))
    d_max = int(max(num_draft))
    ms = MODEL.predict_ms_scalar(
        base_rows + sum(num_draft),
        base_kv + sum(num_draft),
        d_max,
        sum(1 for d in num_draft if d),
        0,
        0,
    )
    return tokens - bar * ms if bar > 0 else tokens / ms


@given(
    acc=st.lists(st.floats(0.05, 0.99), min_size=1, max_size=3),
    max_drafts=st.integers(1, 4),
    extra_rows=st.integers(0, 300),
    bar_scale=st.sampled_from([0.0, 0.8, 1.0, 1.3]),
)
def test_close_to_brute_force(acc, max_drafts, extra_rows, bar_scale):
    n = len(acc)
    survival = np.cumprod(np.tile(np.array(acc)[:, None], (1, max_drafts)), axis=1)  # [n, D]
    weights = np.ones(n)
    base_rows, base_kv = n + extra_rows, 1000 * n
    base_tokens = float(n)
    ar_ms = MODEL.predict_ms_scalar(base_rows, base_kv)
    bar = bar_scale * base_tokens / ar_ms
    choice = plan_depths(
        survival,
        survival.copy(),
        weights,
        np.zeros(n, dtype=np.int64),
        MODEL,
        base_rows,
        base_kv,
        base_tokens,
        0,
        bar,
    )
    got = objective(choice.num_draft, survival, weights, base_rows, base_kv, base_tokens, bar)
    best = max(
        objective(d, survival, weights, base_rows, base_kv, base_tokens, bar)
        for d in itertools.product(range(max_drafts + 1), repeat=n)
    )
    ar = objective([0] * n, survival, weights, base_rows, base_kv, base_tokens, bar)
    assert got >= ar - 1e-9  # never worse than not speculating
    tolerance = 0.02 * abs(best) + 1e-9
    assert got >= best - tolerance
    assert choice.predicted_ms > 0 and (choice.num_draft <= max_drafts).all()


def test_forced_and_excluded_requests():
    survival = np.cumprod(np.full((3, 4), 0.9), axis=1)
    key = survival.copy()
    key[0] = -1.0  # excluded (speculation off, or held in AR by dwell)
    survival_bad = np.cumprod(np.full((3, 4), 0.01), axis=1)
    key_bad = survival_bad.copy()
    key_bad[1, 0] = FORCE_KEY  # must speculate although it does not pay
    for s, k in ((survival, key), (survival_bad, key_bad)):
        choice = plan_depths(s, k, np.ones(3), np.zeros(3, dtype=np.int64), MODEL, 3, 3000, 3.0, 0)
        if k is key:
            assert choice.num_draft[0] == 0 and choice.num_draft[1:].min() > 0
        else:
            assert choice.num_draft[1] >= 1


def test_speculation_wins_at_low_load_and_loses_under_compute_pressure():
    easy = np.cumprod(np.full((1, 7), 0.9), axis=1)
    light = plan_depths(easy, easy, np.ones(1), np.zeros(1, dtype=np.int64), MODEL, 1, 500, 1.0, 0)
    assert light.num_draft[0] >= 5
    hard = np.cumprod(np.full((256, 7), 0.3), axis=1)
    heavy = plan_depths(
        hard, hard, np.ones(256), np.zeros(256, dtype=np.int64), MODEL, 256, 256 * 500, 256.0, 0
    )
    assert heavy.num_draft.sum() < 64


@given(
    acc=st.lists(st.floats(0.3, 0.99), min_size=1, max_size=6),
    max_drafts=st.integers(1, 7),
    extra_rows=st.integers(0, 200),
)
def test_the_plans_price_is_the_cost_models_with_the_engines_ratio(acc, max_drafts, extra_rows):
    """With a profile whose speculating rounds cost the engine more than their terms
    (`spec_round_ratio`), the planner's predicted time of its choice is predict_ms's."""
    model = CostModel(NOISY)
    n = len(acc)
    survival = np.cumprod(np.tile(np.array(acc)[:, None], (1, max_drafts)), axis=1)  # [n, D]
    base_rows, base_kv = n + extra_rows, 1000 * n
    choice = plan_depths(
        survival, survival.copy(), np.ones(n), np.zeros(n, dtype=np.int64), model,
        base_rows, base_kv, float(n), 0,
    )  # fmt: skip
    num_draft = choice.num_draft
    if not num_draft.any():
        return
    want = model.predict_ms_scalar(
        base_rows + int(num_draft.sum()),
        base_kv + int(num_draft.sum()),
        int(num_draft.max()),
        int(np.count_nonzero(num_draft)),
        0,
        0,
        num_draft_rows=int(num_draft.sum()),
    )
    assert abs(choice.predicted_ms - want) <= 1e-9 * want
