"""The simulator: acceptance model, policies through the real scheduler, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scheduler.cost_model import CostModel
from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim import cli
from scheduler.sim.acceptance_model import AcceptanceState
from scheduler.sim.baselines import POLICY_NAMES, make_policy
from scheduler.sim.executor import SimExecutor, default_token
from scheduler.sim.runner import SimSetup, Workload, run_sim
from tests.scheduler.test_lifecycle_invariants import COHORTS, PROFILE, PROFILES


def test_acceptance_paths_follow_the_model():
    for name in ("code", "prose"):
        (cls,) = COHORTS[name]
        state = AcceptanceState(COHORTS[name], seed=3)
        accepted = 0
        for req_id in range(20):
            state.enter(0, req_id)
            accepted += sum(state.accepted(0, t, 1) for t in range(4000))
        assert accepted / 80000 == pytest.approx(cls.mean_acceptance, abs=0.02)
        # true-state's first position is the acceptance of the state it sees
        state.enter(0, 0)
        path = state.path(0)
        s = state.true_survival(np.array([0]), np.array([10]), 3)[0]
        assert s[0] == pytest.approx(cls.easy if path.state_at(10) == 0 else cls.hard)
        assert (np.diff(s) < 0).all()


def test_same_draws_for_every_policy():
    a = AcceptanceState(COHORTS["mixed"], seed=5)
    b = AcceptanceState(COHORTS["mixed"], seed=5)
    b.enter(1, 9)  # entering in another order or slot does not change a request's path
    a.enter(0, 9)
    assert [a.accepted(0, t, 7) for t in range(200)] == [b.accepted(1, t, 7) for t in range(200)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_keeps_greedy_outputs(policy):
    """Whatever a policy decides, each request's tokens are the greedy stream, in order."""
    mode = {"all-ar": "ar", "all-spec": "spec"}.get(policy, "adaptive")
    cfg = SchedulerConfig(max_concurrency=3, spec_mode=mode, spec_depth=5, block_size=8)
    ex = SimExecutor(PROFILE, COHORTS["mixed"], 3, seed=1)
    pol = make_policy(
        policy,
        profile=PROFILE,
        executor=ex,
        max_drafts=4,
        mean_context=80,
        drafter_prefill=True,
    )
    sched = Scheduler(cfg, 200, CostModel(PROFILE), policy=pol)
    for i in range(7):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=tuple(range(50 + i)),
                sampling=SamplingSpec(),
                max_tokens=30 + 5 * i,
            )
        )
    out: dict[int, list[int]] = {i: [] for i in range(7)}
    now = 0.0
    while sched.has_work():
        result = ex.run(sched.plan(now))
        now += result.timings.total_ms / 1e3
        for d in sched.update(result, now):
            out[d.req_id].extend(d.token_ids)
    for i in range(7):
        assert out[i] == [default_token(i, t) for t in range(30 + 5 * i)]
    assert sched.kv.num_free == 200


def test_adaptive_follows_the_better_fixed_mode():
    wl = Workload(num_requests=8, max_tokens=160, prompt_len=64)
    tok = {
        (cohort, p): run_sim(
            PROFILE, COHORTS[cohort], SimSetup(policy=p, concurrency=2), wl
        ).full_live_tok_s
        for cohort in ("code", "prose")
        for p in ("adaptive", "all-ar", "all-spec")
    }
    # code at C = 2: speculation wins big; prose: plain decoding beats full-depth speculation
    assert tok[("code", "all-spec")] > 1.5 * tok[("code", "all-ar")]
    assert tok[("prose", "all-ar")] > tok[("prose", "all-spec")]
    for cohort in ("code", "prose"):
        best = max(tok[(cohort, "all-ar")], tok[(cohort, "all-spec")])
        assert tok[(cohort, "adaptive")] >= 0.98 * best


def test_poisson_workload_and_tenant_mix():
    wl = Workload(
        kind="poisson",
        num_requests=12,
        max_tokens=40,
        prompt_len=32,
        arrival_rate=50.0,
        tenant_mix=(("a", 1.0), ("b", 1.0)),
    )
    r = run_sim(PROFILE, COHORTS["mixed"], SimSetup(policy="adaptive", concurrency=4), wl)
    assert r.num_tokens == 12 * 40
    assert set(r.tenant_slot_seconds) == {"a", "b"}
    assert r.latency_p99_s >= r.latency_mean_s > 0


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli.main(
        [
            "--profile",
            str(PROFILES / "h200-qwen3-8b.json"),
            "--acceptance",
            str(PROFILES / "acceptance.json"),
            "--cohort",
            "code",
            "--concurrency",
            "1,2",
            "--policies",
            "adaptive,all-ar",
            "--requests",
            "3",
            "--max-tokens",
            "24",
            "--prompt-len",
            "16",
            "--workers",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4
    row = data["results"][0]
    for key in (
        "full_live_tok_s",
        "refill_tok_s",
        "mean_accepted_len",
        "mean_rows",
        "route_mix",
        "policy",
        "cohort",
        "concurrency",
    ):
        assert key in row
    assert "full-live tok/s" in capsys.readouterr().out
    assert cli.main(["--policies", "nonsense"]) == 2
    assert cli.main(["--cohort", "nonsense", "--concurrency", "1", "--workers", "1"]) == 2


def test_catchups_are_priced_as_the_engine_runs_them():
    """The simulator's round times come from the cost model; a draft model's catch-up runs in
    graphed passes of a few rows per request and past them as one eager forward (the engine's
    DraftModelDrafter), whose measured time does not fall with more rows."""
    from tests.scheduler.test_policy_check import MEASURED_1130, MODEL_1130

    profile = MODEL_1130.profile
    eager = {int(r): ms for r, ms in MEASURED_1130["draft_model"]["catchup_rows_ms"]}
    capacity = profile.catchup_rows_per_pass * profile.max_catchup_passes
    step = profile.draft_step_ms(np.array([profile.catchup_rows_per_pass]))[0]
    within = profile.first_step_ms_scalar(1, capacity - 1)  # the last pass holds the last row
    assert within == pytest.approx(profile.max_catchup_passes * step)
    # one row more is an eager forward, launch-bound: the fewest rows measured, not a chain step
    assert profile.first_step_ms_scalar(1, capacity) == pytest.approx(eager[min(eager)])
    assert profile.first_step_ms_scalar(1, capacity) > 3 * within / profile.max_catchup_passes
    # the measured curve falls from 256 to 1024 rows; past it the price stays at the last point
    for num_spec, lag in ((1, 2000), (16, 17600), (64, 64000)):
        ms = profile.first_step_ms_scalar(num_spec, lag)
        assert ms >= eager[max(eager)]
        assert ms == pytest.approx(
            float(profile.first_step_ms(np.array([num_spec]), np.array([lag]))[0])
        )


def test_the_switch_back_to_ar_costs_the_profiles_restart():
    """The first AR round after a speculating round starts the engine's run-ahead pipeline
    anew: the simulator adds the profile's `ar_restart_ms` to that round's period (outside the
    executor's time, which calibration compares), and nothing to other AR rounds."""
    from hipfire_serve.cost_profile.engine_steps import SwitchingPolicy
    from scheduler.cost_model import ProfileCost
    from tests.scheduler.test_cost_model import _two_requests_on_the_simulator

    raw = json.loads((PROFILES / "h200-qwen3-8b.json").read_text())
    raw["target"]["ar_restart_ms"] = [[1, 3.0], [2, 5.0]]
    profile = ProfileCost(raw)
    sched, ex = _two_requests_on_the_simulator(profile, CostModel(profile), "spec", max_tokens=60)
    sched.policy = SwitchingPolicy(spec_rounds=1, ar_rounds=3)
    charged, prev_spec = [], False
    while sched.has_work():
        plan = sched.plan(0.0)
        result = ex.run(plan)
        spec = bool(plan.decode.num_draft.any())
        if plan.num_reqs and plan.is_decode_only and not spec:
            charged.append((prev_spec, ex.last_host_ms))
            want = profile.ar_restart_ms_scalar(len(plan.decode)) if prev_spec else 0.0
            assert ex.last_host_ms == pytest.approx(want)
        if plan.num_reqs:
            prev_spec = spec
        sched.update(result, 0.0)
    assert {p for p, _ in charged} == {True, False}  # both kinds of AR round ran
    assert 5.0 in {ms for _, ms in charged}  # two requests: the profile's 2-request point


def test_a_run_that_adopts_an_earlier_runs_knowledge_adds_to_its_evidence():
    """SimSetup.acceptance: the run's scheduler starts from what the earlier run's estimator
    knew at its end (SimResult.acceptance), so its evidence is the sum of both runs'."""
    from scheduler.acceptance import PRIOR_COUNT

    wl = Workload(kind="refill", num_requests=8, prompt_len=64, max_tokens=32)

    def run(known=None):
        setup = SimSetup(policy="all-spec", concurrency=4, acceptance=known)
        return run_sim(PROFILE, COHORTS["code"], setup, wl)

    first, again = run(), run()
    observed = first.acceptance.num_prior_obs - PRIOR_COUNT
    assert observed > 0 and again.acceptance == first.acceptance  # a cold run is repeatable
    carried = run(first.acceptance)
    assert carried.acceptance.num_prior_obs == pytest.approx(PRIOR_COUNT + 2 * observed)
    assert carried.acceptance.prior != first.acceptance.prior
