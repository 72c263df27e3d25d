"""Yield calibration: speculating rounds' accepted drafts against what the estimators expected,
and the adaptive policy's use of the ratio."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.policy import YIELD_MAX, YIELD_MIN, DecodeView, YieldTracker
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.executor import SimExecutor
from tests.scheduler.test_lifecycle_invariants import PROFILE
from tests.scheduler.test_policy import _FixedSurvival, _view, specs


def test_factor_follows_the_realised_share_by_its_evidence_and_fades_without_speculation():
    tracker = YieldTracker()
    assert tracker.factor == 1.0
    for _ in range(3):  # a few drafts of evidence barely move it
        tracker.observe(expected=1.0, accepted=0.0)
    assert tracker.factor > 0.9
    for _ in range(200):  # a large batch accepting half of what its estimates said
        tracker.observe(expected=20.0, accepted=10.0)
    assert 0.5 < tracker.factor < 0.55
    for _ in range(40):  # an AR stretch between two entries keeps the evidence
        tracker.relax()
    assert tracker.factor < 0.56
    for _ in range(4000):  # a long time without drafts: it fades
        tracker.relax()
    assert tracker.factor > 0.99
    tracker.observe(expected=0.0, accepted=3.0)  # nothing expected: no evidence
    assert tracker.factor > 0.99


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 50.0), st.floats(0.0, 60.0), st.booleans()),
        min_size=1,
        max_size=80,
    )
)
def test_factor_stays_within_its_bounds(rounds):
    tracker = YieldTracker()
    for expected, accepted, spec in rounds:
        if spec:
            tracker.observe(expected, accepted)
        else:
            tracker.relax()
        assert YIELD_MIN <= tracker.factor <= YIELD_MAX


def test_a_yield_below_the_estimates_keeps_a_near_break_even_batch_in_ar():
    policy = _FixedSurvival(0.0, 0)
    cost = CostModel(PROFILE)

    def speculates(acceptance, factor):
        policy.next_survival = np.cumprod(np.full((16, 7), acceptance), axis=1)
        view = DecodeView(**{**_view(False, False).__dict__, "yield_factor": factor})
        return bool(policy.decide(view, None, cost).num_draft.any())

    lo, hi = 0.01, 0.99  # break-even acceptance at the estimators' word, by bisection
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if speculates(mid, 1.0) else (mid, hi)
    assert 0.05 < hi < 0.95
    above = min(hi * 1.05, 0.99)
    assert speculates(above, 1.0)
    assert not speculates(above, 0.7)  # the same estimates, known to earn 70% of what they say


def test_the_scheduler_feeds_each_speculating_rounds_expected_and_accepted_drafts():
    cfg = SchedulerConfig(max_concurrency=4, spec_depth=8, max_prefill_tokens=256)
    sched = Scheduler(cfg, 20000, CostModel(PROFILE))
    easy = (AcceptanceClass(1.0, 0.9, 0.9, 0.0, 0.0),)
    ex = SimExecutor(PROFILE, easy, cfg.max_concurrency, seed=3)
    for spec in specs(4, max_tokens=120):
        sched.add_request(spec)
    seen = []
    observe = sched.yield_tracker.observe
    sched.yield_tracker.observe = lambda e, a: (seen.append((e, a)), observe(e, a))
    now, want = 0.0, []
    while sched.has_work():
        plan = sched.plan(now)
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        d = plan.decode.num_draft
        if d.any():
            expected = sched._in_flight.latest.expected_accepted
            completing = plan.predicted_tokens - len(d) - expected
            assert abs(completing - round(completing)) < 1e-9  # whole prefills, no drafts
            n = len(d)
            want.append((expected, float(np.minimum(result.out.num_accepted[:n], d).sum())))
        sched.update(result, now)
    assert len(want) > 5 and seen == want
    assert 0.6 < sched.yield_tracker.factor < 1.5  # learned estimators on a stationary cohort
