"""The drafter catch-up in the adaptive policy's decisions, one rule at a time, on the H200
profile of 2026-11-30 (catch-ups in graphed passes of 4 rows per request, at most 8, and one
eager forward past them): the catch-ups of a round priced as the one first step they share,
spread over the SPEC rounds a request's own exit rate leaves it, whole-prompt catch-ups held
back next to prefill chunks, and probes not held by the dwell."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.acceptance import AcceptanceEstimator
from scheduler.catchup_pricing import (
    CATCHUP_HORIZON_ROUNDS,
    SpecStretches,
    amortized_catchup_ms,
    catchup_share,
    deferred_catchups,
    joint_catchup_ms,
)
from scheduler.depth_planner import Catchup, plan_depths, prefix_catchup_ms
from scheduler.policy import AdaptivePolicy
from tests.scheduler.test_policy_check import MODEL_1130 as MODEL
from tests.scheduler.test_policy_check import decode_view

PROFILE = MODEL.profile
PASS_CAPACITY = PROFILE.catchup_rows_per_pass * PROFILE.max_catchup_passes  # 32 rows


def _view(n=8, lag=1000, remaining=120, num_prefill_rows=0, was_spec=False, in_dwell=False):
    return decode_view(n, lag, remaining, num_prefill_rows, was_spec=was_spec, in_dwell=in_dwell)


def _code_estimator(n: int) -> AcceptanceEstimator:
    """An estimator that has seen code-like chains (most drafts accepted) on every slot."""
    est = AcceptanceEstimator(num_slots=n, max_drafts=7)
    slots = np.arange(n)
    for _ in range(12):
        est.observe(slots, np.full(n, 7), np.full(n, 6))
    return est


def test_a_shared_catchup_is_priced_as_one_first_step():
    """Sixteen requests that each lag a whole prompt: the first step catches them all up in
    one eager forward, so together they are charged that forward's excess once (split by lag
    rows), not sixteen forwards."""
    n, lag = 16, 1000
    view = _view(n, lag)
    survival = np.cumprod(np.full((n, 7), 0.85), axis=1)
    share = catchup_share(view, survival)
    first = np.ones(n, dtype=bool)
    num_spec = np.arange(1, n + 1)
    charged = prefix_catchup_ms(
        Catchup(view.drafter_lag, share), np.arange(n), first, num_spec, MODEL
    )  # [n] by prefix
    joint = PROFILE.first_step_ms_scalar(n, n * lag) - PROFILE.first_step_ms_scalar(n, 0)
    assert np.isclose(charged[-1], joint * share.mean())
    alone = amortized_catchup_ms(view, survival, MODEL)  # each as if it caught up alone
    assert charged[-1] < alone.sum() / 4
    # the per-request charge if all catch up together is the same split
    assert np.isclose(joint_catchup_ms(view, share, MODEL).sum(), charged[-1])
    # at the all-AR rate as the bar: priced alone, no request pays its catch-up back; priced
    # as shared, all of them do
    key = survival.copy()
    base = (n, n * 1000, float(n), 0, n / MODEL.predict_ms_scalar(n, n * 1000))
    assert not plan_depths(survival, key, np.ones(n), alone, MODEL, *base).num_draft.any()
    shared = plan_depths(survival, key, np.ones(n), Catchup(view.drafter_lag, share), MODEL, *base)
    assert (shared.num_draft > 0).all()


@settings(max_examples=40, deadline=None)
@given(
    lags=st.lists(st.integers(0, 2000), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefix_catchup_follows_the_cost_model(lags, seed):
    """Whatever the lags and the ranking: each prefix is charged the cost model's first step
    over its lag rows less the plain step, times the lag-weighted share, never below 0."""
    rng = np.random.default_rng(seed)
    n = len(lags)
    lag = np.asarray(lags, dtype=np.int64)
    share = rng.uniform(1 / 512, 1.0, size=n)
    order = rng.permutation(n)  # one first position per request, ranked
    num_spec = np.arange(1, n + 1)
    got = prefix_catchup_ms(Catchup(lag, share), order, np.ones(n, dtype=bool), num_spec, MODEL)
    for p in range(n):
        taken = order[: p + 1]
        total = int(lag[taken].sum())
        want = 0.0
        if total:
            extra = PROFILE.first_step_ms_scalar(p + 1, total) - PROFILE.first_step_ms_scalar(
                p + 1, 0
            )
            want = max(extra, 0.0) * float((lag[taken] * share[taken]).sum()) / total
        assert np.isclose(got[p], want)
        assert got[p] >= 0


def test_a_request_that_left_speculation_expects_a_short_stretch():
    stretches = SpecStretches()
    view = _view(2, lag=0)
    assert np.allclose(stretches.expected_rounds(view), CATCHUP_HORIZON_ROUNDS)  # no history
    stretches.observe(view, np.array([3, 0]))
    spec_view = replace(view, was_spec=np.array([True, False]))
    stretches.observe(spec_view, np.array([3, 0]))
    stretches.observe(spec_view, np.array([0, 0]))  # request 0 leaves after two SPEC rounds
    expected = stretches.expected_rounds(view)
    assert np.isclose(expected[0], 3 / (1 + 1 / CATCHUP_HORIZON_ROUNDS))
    assert np.isclose(expected[1], CATCHUP_HORIZON_ROUNDS)  # never speculated: no exit seen
    # its catch-up is then spread over those rounds, not over its remaining life
    survival = np.cumprod(np.full((2, 7), 0.6), axis=1)
    share = catchup_share(view, survival, expected)
    assert np.isclose(share[0], 1 / expected[0])
    assert np.isclose(share[1], (1 + survival[1].sum()) / view.num_remaining[1])
    # a new request in the slot starts without history
    fresh = replace(view, req_ids=np.array([7, 1]))
    assert np.isclose(stretches.expected_rounds(fresh)[0], CATCHUP_HORIZON_ROUNDS)


def test_whole_prompt_catchups_wait_for_a_decode_only_round():
    n = 8
    est = _code_estimator(n)
    lag = np.array([1000] * 6 + [PASS_CAPACITY, 0])  # six whole prompts, two within the passes
    prefill = _view(n, num_prefill_rows=2048)
    prefill = replace(prefill, drafter_lag=lag)
    deferred = deferred_catchups(prefill, PROFILE)
    assert deferred.tolist() == [True] * 6 + [False, False]
    decision = AdaptivePolicy().decide(prefill, est, MODEL)
    assert not decision.num_draft[:6].any()
    # a request asked to speculate is never held back
    must = replace(prefill, must_spec=np.arange(n) == 0)
    assert not deferred_catchups(must, PROFILE)[0]
    # in a decode-only round the same requests catch up together
    decode = replace(_view(n), drafter_lag=lag)
    assert (AdaptivePolicy().decide(decode, est, MODEL).num_draft[:6] > 0).all()


def test_a_probe_is_not_held_by_the_dwell():
    """A probe drafts one position for one request; in its dwell rounds the planner decides
    for it as for any other request instead of holding it (and, behind it, the batch's
    shared catch-up)."""
    n = 4
    est = AcceptanceEstimator(num_slots=n, max_drafts=7, prior_acceptance=0.2)
    policy = AdaptivePolicy()
    view = _view(n, lag=np.array([900, 40, 30, 1200]))
    probe = policy.decide(view, est, MODEL)
    assert probe.num_draft.tolist() == [0, 0, 1, 0] and "probe" in probe.reason
    # next round: the probed request speculated and is in its dwell; enough evidence that
    # drafting does not pay (no more probes)
    after = replace(
        view,
        drafter_lag=np.array([901, 41, 0, 1201]),
        was_spec=np.arange(n) == 2,
        in_dwell=np.arange(n) == 2,
    )
    for _ in range(2):
        est.observe(np.arange(n), np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    assert not est.needs_probe()
    assert policy.decide(after, est, MODEL).num_draft[2] == 0
    # a request that switched by the planner's own choice is still held
    held = AdaptivePolicy()
    assert held.decide(after, est, MODEL).num_draft[2] > 0


def test_the_follow_question_ignores_lag_weighs_the_cost_and_changes_nothing():
    """`following_pays` (asked when prompts start under --drafter-follows-prefill auto): a
    code-like batch whose drafters lag a whole prompt, with too few tokens left to pay that
    catch-up back, stays in AR, but following pays where the tokens to come save more than the
    follow costs; not where the follow costs more than they save; a batch whose estimators
    expect little is not followed; asking leaves the policy's state as it was."""
    n = 8
    policy = AdaptivePolicy()
    lagging = _view(n, lag=1000, remaining=3)
    code = _code_estimator(n)
    assert not AdaptivePolicy().decide(lagging, code, MODEL).num_draft.any()
    assert policy.following_pays(lagging, code, MODEL, follow_ms=4.0, num_tokens=1000.0)
    assert not policy.following_pays(lagging, code, MODEL, follow_ms=4.0, num_tokens=1.0)
    assert not policy.following_pays(lagging, code, MODEL, follow_ms=1e6, num_tokens=1000.0)
    poor = AcceptanceEstimator(num_slots=n, max_drafts=7, prior_acceptance=0.05)
    assert not policy.following_pays(lagging, poor, MODEL, follow_ms=0.0, num_tokens=1000.0)
    assert not policy.following_pays(
        replace(lagging, may_spec=np.zeros(n, dtype=bool)), code, MODEL, 0.0, 1000.0
    )
    state = (policy._probe_check.copy(), policy._probe_req_id, policy.stretches._req_id.copy())
    policy.following_pays(lagging, code, MODEL, 4.0, 1000.0)
    assert policy._probe_check == state[0] and policy._probe_req_id == state[1]
    assert np.array_equal(policy.stretches._req_id, state[2])


@pytest.mark.parametrize("lag", [0, 40])
def test_an_entry_that_must_catch_up_needs_the_margin(monkeypatch, lag):
    """A batch entering speculation (nobody speculated last round) whose drafters must catch
    up enters only at a predicted gain of ENTRY_MARGIN x its entrants' share of the batch; a
    caught-up batch (no catch-up to waste) enters at any gain."""
    from scheduler import policy as policy_module

    n = 4
    view = _view(n, lag=lag, remaining=120)
    code = _code_estimator(n)
    free = AdaptivePolicy().decide(view, code, MODEL)
    assert free.num_draft.any()
    gain = float(free.reason.split("pred ")[1].split("%")[0]) / 100
    share = np.count_nonzero(free.num_draft) / n
    # a margin just above what this plan predicts: held in AR where a catch-up is at stake
    monkeypatch.setattr(policy_module, "ENTRY_MARGIN", (gain + 0.01) / share)
    held = AdaptivePolicy().decide(view, code, MODEL)
    assert held.num_draft.any() == (lag == 0)
    assert ("entry below margin" in held.reason) == (lag > 0)
    # just below it: entered
    monkeypatch.setattr(policy_module, "ENTRY_MARGIN", (gain - 0.01) / share)
    assert AdaptivePolicy().decide(view, code, MODEL).num_draft.any()
