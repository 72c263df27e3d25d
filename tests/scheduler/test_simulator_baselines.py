"""The simulator's reference policies: `clairvoyant` (the best depths of every round given its
true outcomes) and the `sticky` gate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.plan import SamplingSpec
from scheduler.policy import DecodeView, depth_caps
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.baselines import COST_EMA, GATE_MARGIN, POLICY_NAMES, StickyGatePolicy
from scheduler.sim.executor import SimExecutor
from scheduler.sim.oracles import ClairvoyantPolicy
from scheduler.sim.runner import SimSetup, Workload, run_sim
from tests.scheduler.test_lifecycle_invariants import COHORTS, PROFILE


def _drive(
    make_policy,
    cohort,
    concurrency,
    num_requests,
    max_tokens,
    seed=0,
    time_scale=None,
    decide_ahead=False,
    on_plan=None,
    on_result=None,
):
    """Runs requests through the real scheduler and the simulated executor as the runner does
    (plan_in_flight before a decision made ahead, observe_round after every round with
    requests), noise off; `on_plan(plan)` and `on_result(plan, result)` see every round as it
    is planned and once it has run. Returns the policy."""
    cfg = SchedulerConfig(max_concurrency=concurrency, spec_depth=8, block_size=16)
    ex = SimExecutor(
        PROFILE, COHORTS[cohort], concurrency, seed=seed, noise_sigma=0.0, time_scale=time_scale
    )
    policy = make_policy(ex)
    sched = Scheduler(cfg, 64 * concurrency, CostModel(PROFILE), policy=policy)
    for i in range(num_requests):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=tuple(range(1000, 1040 + 7 * i)),
                sampling=SamplingSpec(),
                max_tokens=max_tokens,
            )
        )
    now = 0.0
    while sched.has_work():
        plan = sched.plan(now)
        if on_plan is not None:
            on_plan(plan)
        if decide_ahead:
            if hasattr(policy, "plan_in_flight"):
                policy.plan_in_flight(plan)
            sched.prepare_decision()
        result = ex.run(plan)
        if on_result is not None:
            on_result(plan, result)
        period_ms = result.timings.total_ms + ex.last_host_ms
        now += period_ms / 1e3
        sched.update(result, now)
        if plan.num_reqs and hasattr(policy, "observe_round"):
            policy.observe_round(plan, period_ms)
    assert sched.kv.num_free == 64 * concurrency
    return policy


class _CheckedOracle(ClairvoyantPolicy):
    """clairvoyant, its every choice compared with all depth vectors of the round."""

    def decide(self, view, estimator, cost_model):
        decision = super().decide(view, estimator, cost_model)
        caps = depth_caps(view)
        facts = self.facts(view, caps)
        best = max(
            self.objective(facts, np.array(d, dtype=np.int64))
            for d in itertools.product(*(range(c + 1) for c in caps.tolist()))
        )
        assert self.objective(facts, decision.num_draft) == pytest.approx(best, rel=1e-12)
        return decision


@pytest.mark.parametrize("cohort,concurrency", [("code", 2), ("prose", 3), ("mixed", 3)])
def test_clairvoyant_takes_the_best_depths_of_every_round(cohort, concurrency):
    """Per round nothing scores more than clairvoyant's choice (small batches, exhaustively)."""
    _drive(lambda ex: _CheckedOracle(ex, False), cohort, concurrency, 4, 48)


def test_a_decision_made_ahead_knows_the_outcomes_of_its_round():
    """With decide_ahead the next round is decided while the current one runs: clairvoyant
    reads the traces past the current round's outcomes, so the accepted drafts it expects are
    the ones its round gets, for decisions made ahead as for the others."""
    expected = {}  # (req_ids, num_draft) -> accepted drafts clairvoyant expects
    when_planned = {}  # `expected` as the round was planned (before the next decision)
    checked = []

    class Recorded(ClairvoyantPolicy):
        def decide(self, view, estimator, cost_model):
            decision = super().decide(view, estimator, cost_model)
            runs = self.facts(view, depth_caps(view)).runs
            key = (tuple(view.req_ids.tolist()), tuple(decision.num_draft.tolist()))
            expected[key] = np.minimum(decision.num_draft, runs).tolist()
            return decision

    def check(plan, result):
        dec = plan.decode
        key = (tuple(dec.req_ids.tolist()), tuple(dec.num_draft.tolist()))
        if dec.num_draft.any() and key in when_planned:
            checked.append(when_planned[key] == result.out.num_accepted[: len(dec)].tolist())

    _drive(
        lambda ex: Recorded(ex, False),
        "mixed",
        4,
        8,
        96,
        decide_ahead=True,
        on_plan=lambda plan: when_planned.update(expected),
        on_result=check,
    )
    assert len(checked) > 50 and all(checked)


def test_clairvoyant_leads_every_policy_on_a_small_grid():
    """Full-live tokens/s of clairvoyant >= every other policy's at every point of this grid
    (seed 0). It is a bound per round only: over a run a policy can pass it (seed 2, threshold
    at mixed C = 16, docs/perf/scheduler.md), so this guards a reading, not a theorem. Timing
    noise is off: its draws are taken one per round, and policies run different numbers of
    rounds, so with noise each meets other draws."""
    for cohort, c in itertools.product(("code", "prose", "mixed"), (1, 4, 16)):
        wl = Workload(num_requests=max(4, 2 * c), prompt_len=64, max_tokens=96)
        tok = {
            p: run_sim(
                PROFILE, COHORTS[cohort], SimSetup(policy=p, concurrency=c, noise_sigma=0.0), wl
            ).full_live_tok_s
            for p in POLICY_NAMES
        }
        bound = tok.pop("clairvoyant")
        for policy, value in tok.items():
            assert value <= bound, f"{cohort} C={c}: {policy} {value:.0f} > clairvoyant {bound:.0f}"


def _gate_log(policy_cls):
    """A sticky gate recording each decision: [(req_ids, caps, num_draft)]."""

    class Recording(policy_cls):
        def __init__(self):
            super().__init__()
            self.log = []

        def decide(self, view, estimator, cost_model):
            decision = super().decide(view, estimator, cost_model)
            self.log.append((view.req_ids.copy(), depth_caps(view), decision.num_draft.copy()))
            return decision

    return Recording()


@given(
    cohort=st.sampled_from(["code", "prose", "mixed"]),
    concurrency=st.integers(1, 6),
    num_requests=st.integers(1, 10),
    max_tokens=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    spec_scale=st.floats(0.5, 3.0),
)
def test_a_sticky_gate_never_changes_during_a_requests_life(
    cohort, concurrency, num_requests, max_tokens, seed, spec_scale
):
    """Each request speculates at full depth in every round or in none, as decided on its
    first decoding round, whatever the measured costs (speculating rounds scaled) do meanwhile."""

    def scale(num_rows, speculating):
        return spec_scale if speculating else 1.0

    policy = _drive(
        lambda ex: _gate_log(StickyGatePolicy),
        cohort,
        concurrency,
        num_requests,
        max_tokens,
        seed,
        scale,
    )
    seen: dict[int, bool] = {}
    for req_ids, caps, num_draft in policy.log:
        for r, cap, d in zip(req_ids.tolist(), caps.tolist(), num_draft.tolist()):
            on = seen.setdefault(r, policy.gate[r])
            assert d == (cap if on else 0)
    assert seen == policy.gate


def test_the_sticky_gate_speculates_only_past_its_margin():
    """Newcomers speculate when the cohort's EMA-calibrated rate speculating beats its rate in
    AR by more than GATE_MARGIN, and not at a smaller gain."""

    class Prior:
        def survival(self, slots):
            return np.cumprod(np.full((len(slots), 7), 0.8), axis=1)

    n = 4
    view = DecodeView(
        req_ids=np.arange(n),
        slots=np.arange(n),
        num_remaining=np.full(n, 1000),
        drafter_lag=np.zeros(n, dtype=np.int64),
        may_spec=np.ones(n, dtype=bool),
        must_spec=np.zeros(n, dtype=bool),
        was_spec=np.zeros(n, dtype=bool),
        in_dwell=np.zeros(n, dtype=bool),
        weights=np.ones(n),
        max_drafts=7,
        base_rows=n,
        base_kv_tokens=n * 1000,
        base_tokens=float(n),
        num_prefill_rows=0,
        num_live=n,
        cohort_changed=True,
        draining=False,
    )
    probe = StickyGatePolicy()
    probe._profile = PROFILE
    caps, gain = depth_caps(view), Prior().survival(view.slots).sum(1)
    ratio = probe.cohort_rate(view, caps > 0, caps, gain) / probe.cohort_rate(
        view, np.zeros(n, dtype=bool), caps, gain
    )
    for gain_over_ar, speculates in ((1.0 + GATE_MARGIN / 2, False), (1.0 + 2 * GATE_MARGIN, True)):
        gate = StickyGatePolicy()
        gate.correction[1] = ratio / gain_over_ar  # speculating rounds measured this much dearer
        decision = gate.decide(view, Prior(), CostModel(PROFILE))
        assert decision.num_draft.tolist() == ([7] * n if speculates else [0] * n)


def test_the_sticky_gates_cost_correction_follows_measured_rounds():
    """The correction of speculating rounds is an EMA (COST_EMA) of measured / priced time: with
    speculating rounds running 3x their price it climbs toward 3, AR rounds stay at their price,
    and requests admitted once it has learned that stay in AR."""
    ema = []

    class Tracked(StickyGatePolicy):
        def observe_round(self, plan, period_ms):
            before = self.correction[1]
            super().observe_round(plan, period_ms)
            if plan.decode.num_draft.any() and not plan.prefills:
                ema.append((before, self.correction[1]))

    policy = _drive(
        lambda ex: Tracked(), "code", 2, 10, 120, time_scale=lambda rows, spec: 3.0 if spec else 1.0
    )
    assert ema[0][0] == 1.0 and len(ema) > 10
    for before, after in ema:
        assert after == pytest.approx(before + COST_EMA * (3.0 - before))
    assert policy.correction[0] == pytest.approx(1.0)
    assert policy.gate[0] and not policy.gate[9]  # the first requests speculate, the last do not
