"""Speculation policy behaviour: modes, per-request choices, hysteresis, observability."""

from __future__ import annotations

import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.catchup_pricing import amortized_catchup_ms
from scheduler.cost_model import CostModel
from scheduler.depth_planner import plan_depths
from scheduler.plan import Mode, SamplingSpec
from scheduler.policy import HYSTERESIS, MIN_DWELL_ROUNDS, AdaptivePolicy, DecodeView
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.executor import SimExecutor
from tests.scheduler.test_lifecycle_invariants import PROFILE


def drive(cfg, classes, specs, num_rounds, seed=0, num_blocks=20000):
    sched = Scheduler(cfg, num_blocks, CostModel(PROFILE))
    ex = SimExecutor(PROFILE, classes, cfg.max_concurrency, seed=seed)
    for spec in specs:
        sched.add_request(spec)
    plans = []
    now = 0.0
    for _ in range(num_rounds):
        if not sched.has_work():
            break
        plan = sched.plan(now)
        plans.append(plan)
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        sched.update(result, now)
    return sched, plans


def specs(n, max_tokens=400, speculation="auto", start=0):
    return [
        RequestSpec(
            req_id=start + i,
            prompt_token_ids=tuple(range(100, 164)),
            sampling=SamplingSpec(),
            max_tokens=max_tokens,
            speculation=speculation,
        )
        for i in range(n)
    ]


EASY = (AcceptanceClass(1.0, 0.95, 0.95, 0.0, 0.0),)
HARD = (AcceptanceClass(1.0, 0.1, 0.1, 0.0, 0.0),)


def test_easy_requests_speculate_deep_hard_ones_do_not():
    cfg = SchedulerConfig(max_concurrency=4, spec_depth=8)
    _, plans = drive(cfg, EASY, specs(4), 60)
    late = [q for p in plans[-20:] for q in p.reqs]
    # every late request-round speculates, except a request's last (one token left: a draft
    # could not be used)
    for i, p in enumerate(plans[-20:]):
        later = {q.req_id for p2 in plans[len(plans) - 20 + i + 1 :] for q in p2.reqs}
        assert all(q.mode == Mode.SPEC or q.req_id not in later for q in p.reqs)
    assert np.mean([q.mode == Mode.SPEC for q in late]) >= 0.95
    assert np.mean([q.num_draft for q in late]) >= 5
    _, plans = drive(cfg, HARD, specs(4), 60)
    late = [q for p in plans[-20:] for q in p.reqs]
    assert sum(q.mode == Mode.SPEC for q in late) <= 0.25 * len(late)  # only re-probes


def test_request_choices_and_modes_are_respected():
    cfg = SchedulerConfig(max_concurrency=3, spec_depth=4)
    mixed = specs(1, speculation="off") + specs(1, speculation="on", start=1)
    mixed += specs(1, start=2)
    _, plans = drive(cfg, HARD, mixed, 40)
    for plan in plans:
        for q in plan.reqs:
            if q.mode == Mode.PREFILL:
                continue
            if q.req_id == 0:
                assert q.mode == Mode.AR
            if q.req_id == 1:
                assert q.mode == Mode.SPEC  # asked for it although acceptance is poor
    for mode, has_drafter in (("ar", True), ("adaptive", False)):
        cfg = SchedulerConfig(max_concurrency=2, spec_mode=mode, has_drafter=has_drafter)
        _, plans = drive(cfg, EASY, specs(2, speculation="on"), 30)
        assert all(q.mode != Mode.SPEC for p in plans for q in p.reqs)


def test_route_string_and_stats_describe_the_round():
    cfg = SchedulerConfig(max_concurrency=4, spec_depth=8)
    sched, plans = drive(cfg, EASY, specs(4), 30)
    for plan in plans:
        assert len(plan.route) == len(plan.reqs)
        for letter, q in zip(plan.route, plan.reqs):
            assert letter == {Mode.PREFILL: "P", Mode.AR: "A", Mode.SPEC: "S"}[q.mode]
        assert plan.reason
        if plan.reqs:
            assert plan.predicted_ms > 0
    spec_plan = next(p for p in reversed(plans) if "S" in p.route)
    assert spec_plan.spec_depth - 1 == max(q.num_draft for q in spec_plan.reqs)
    stats = sched.stats
    assert stats.num_running == 4 and stats.measured_ms > 0
    assert stats.num_accepted <= stats.num_drafted
    assert 0 < stats.kv_usage < 1


class _FixedSurvival(AdaptivePolicy):
    """The adaptive policy fed with a given survival curve instead of the estimator's, without
    probes (there is no estimator to learn from them)."""

    def __init__(self, hysteresis, min_dwell_rounds):
        super().__init__(hysteresis, min_dwell_rounds)
        self.next_survival = None

    def survival(self, view, estimator):
        return self.next_survival

    def wants_probe(self, estimator):
        return False

    def first_probe(self, view, *args):
        return np.zeros(len(view.req_ids), dtype=bool)


def _view(was_spec, in_dwell, n=16, lag=0):
    return DecodeView(
        req_ids=np.arange(n),
        slots=np.arange(n),
        num_remaining=np.full(n, 1000),
        drafter_lag=np.full(n, lag, dtype=np.int64),
        may_spec=np.ones(n, dtype=bool),
        must_spec=np.zeros(n, dtype=bool),
        was_spec=np.full(n, was_spec),
        in_dwell=np.full(n, in_dwell),
        weights=np.ones(n),
        max_drafts=7,
        base_rows=n,
        base_kv_tokens=n * 1000,
        base_tokens=float(n),
        num_prefill_rows=0,
        num_live=n,
        cohort_changed=False,
        draining=False,
    )


def _speculates(policy, acceptance, was_spec=False, in_dwell=False):
    policy.next_survival = np.cumprod(np.full((16, 7), acceptance), axis=1)
    decision = policy.decide(_view(was_spec, in_dwell), None, CostModel(PROFILE))
    return bool(decision.num_draft.any())


def test_hysteresis_and_dwell_stop_flapping_at_the_boundary():
    plain = _FixedSurvival(0.0, 0)
    lo, hi = 0.01, 0.99  # break-even acceptance of this batch, by bisection
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _speculates(plain, mid) else (mid, hi)
    wobble = [hi * (1.01 if i % 2 else 0.99) for i in range(20)]  # estimates around it

    def flips(policy):
        spec, since, count = False, 99, 0
        for a in wobble:
            now = _speculates(policy, a, spec, since < policy.min_dwell_rounds)
            count += now != spec
            since = 0 if now != spec else since + 1
            spec = now
        return count

    assert flips(plain) >= 15
    assert flips(_FixedSurvival(HYSTERESIS, MIN_DWELL_ROUNDS)) <= 1


def test_catch_up_is_amortised_not_a_lock_out():
    """After a long prefill the drafter must catch up on the whole context once; charged to a
    single round that never pays, amortised over the request's future rounds it does."""
    n, lag = 128, 400
    policy = _FixedSurvival(0.0, 0)
    policy.next_survival = np.cumprod(np.full((n, 7), 0.9), axis=1)
    view = _view(False, False, n=n, lag=lag)
    model = CostModel(PROFILE)
    assert policy.decide(view, None, model).num_draft.any()
    step = model.profile.draft_step_ms
    full_ms = step(np.full(n, n + lag)) - step(np.full(n, n))  # [n] each one's whole catch-up
    myopic = plan_depths(
        policy.next_survival,
        policy.next_survival,
        np.ones(n),
        full_ms,
        model,
        n,
        n * 1000,
        float(n),
        0,
    )
    assert not myopic.num_draft.any()
    assert (amortized_catchup_ms(view, policy.next_survival, model) < full_ms).all()


def test_estimator_learns_per_request():
    est = AcceptanceEstimator(num_slots=2, max_drafts=7)
    prior = est.survival(np.array([0]))[0]
    for _ in range(10):
        est.decay()
        est.observe(np.array([0, 1]), np.array([7, 7]), np.array([7, 0]))
    raw_good, raw_bad = est.belief[[0, 1]] @ est.survival_matrix()  # before calibration
    assert raw_good[0] > prior[0] + 0.1 and raw_bad[0] < 0.3
    good, bad = est.survival(np.array([0, 1]))
    assert good[0] > prior[0] and bad[0] < 0.3
    assert (np.diff(good) <= 0).all()  # survival never rises with depth
    # an idle request drifts back towards the prior
    for _ in range(200):
        est.decay()
    assert abs(est.survival(np.array([1]))[0, 0] - est.survival(np.array([0]))[0, 0]) < 0.05
    est.reset(1)
    assert np.allclose(est.belief[1], est.prior)


def test_rate_bar_learns_from_decode_only_rounds():
    """Next to a prefill chunk drafts ride on an eager forward almost for free; the uplift of
    such rounds must not become the price a decode round's drafts have to pay."""
    cfg = SchedulerConfig(max_concurrency=8, spec_depth=8, max_prefill_tokens=64)
    sched = Scheduler(cfg, 20000, CostModel(PROFILE))
    ex = SimExecutor(PROFILE, EASY, cfg.max_concurrency, seed=0)
    for spec in specs(8):
        sched.add_request(spec)
    tracker = sched.rate_tracker
    now = 0.0
    num_mixed = num_decode_fed = 0
    for _ in range(40):
        before = (tracker._tokens, tracker._ar_tokens)
        plan = sched.plan(now)
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        sched.update(result, now)
        fed = (tracker._tokens, tracker._ar_tokens) != before
        if not plan.is_decode_only:
            assert not fed, plan.route
            num_mixed += "S" in plan.route
        else:
            num_decode_fed += fed
    assert num_mixed > 0  # rounds with a prefill chunk and speculating decoders happened
    assert num_decode_fed > 20
    assert tracker.uplift > 1.2  # easy requests: speculation beats AR in decode rounds


def test_a_probe_rounds_positions_weigh_more_in_the_calibration():
    """The scheduler hands the estimator a probe round's outcomes (`Decision.probe`, carried by
    the plan) with PROBE_CALIB_WEIGHT and every other speculating round's with 1."""
    from scheduler.acceptance import PROBE_CALIB_WEIGHT
    from scheduler.policy import Decision

    probes = [True, False]

    class Scripted(AdaptivePolicy):
        def decide(self, view, estimator, cost_model):
            num_draft = np.zeros(len(view.req_ids), dtype=np.int64)
            if not probes:
                return Decision(num_draft, "k=0")
            num_draft[0] = 2
            probe = probes.pop(0)
            return Decision(num_draft, "k=1/2 d_max=2", probe=probe)

    cfg = SchedulerConfig(max_concurrency=2, block_size=16, spec_depth=4, max_prefill_tokens=512)
    sched = Scheduler(cfg, 2000, CostModel(PROFILE), policy=Scripted())
    ex = SimExecutor(PROFILE, EASY, 2, seed=0)
    for spec in specs(2, max_tokens=50):
        sched.add_request(spec)
    weights, plan_probes = [], []
    while sched.has_work() and len(weights) < 2:
        plan = sched.plan(0.0)
        sched.update(ex.run(plan), 0.0)
        obs = sched._outcomes.rounds[-1]
        if obs is not None:
            weights.append(obs.weight)
            plan_probes.append(plan.probe)
    assert plan_probes == [True, False]
    assert weights == [PROBE_CALIB_WEIGHT, 1.0] and PROBE_CALIB_WEIGHT > 1.0


def test_rate_bar_counts_a_speculating_rounds_host_time():
    """The bar is compared with plans priced as periods (the engine's host time around a
    speculating round included); the executor's measurement leaves that time out, so the
    tracker is fed the measurement plus the profile's host time of the round."""
    from scheduler.cost_model import ProfileCost
    from scheduler.sim.policy_check import load_profile
    from tests.scheduler.test_policy_check import ROOT

    profile = ProfileCost(
        load_profile(ROOT / "scheduler" / "profiles" / "h200-qwen3-8b-bench-2026-11-30.json")
    )
    cfg = SchedulerConfig(max_concurrency=4, spec_depth=8, spec_mode="spec")
    sched = Scheduler(cfg, 20000, CostModel(profile))
    ex = SimExecutor(profile, EASY, cfg.max_concurrency, seed=0)
    for spec in specs(4):
        sched.add_request(spec)
    fed = []
    observe = sched.rate_tracker.observe

    def record(tokens, ms, rate):
        fed.append(ms)
        observe(tokens, ms, rate)

    sched.rate_tracker.observe = record
    now, checked = 0.0, 0
    for _ in range(12):
        plan = sched.plan(now)
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        fed.clear()
        sched.update(result, now)
        if plan.is_decode_only and plan.spec_depth > 1:
            host = profile.round_spec_host_ms(
                plan.num_rows, 0, int(np.count_nonzero(plan.decode.num_draft)),
                plan.spec_depth - 1, int(plan.decode.num_draft.sum()),
            )  # fmt: skip
            assert host > 0 and fed == [result.timings.total_ms + host]
            checked += 1
    assert checked > 5
