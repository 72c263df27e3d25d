"""The columnar round contract: plan columns and their per-request views agree, results map
back in plan order, and a stop reported after update() (the engine's stop strings) ends the
request with exact truncation while its round in flight is dropped."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.plan import Emitted, Mode, PhaseTimes, RoundPlan, RoundResult, SamplingSpec
from scheduler.request import ReqState, RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.executor import SimExecutor
from scheduler.sim.plan_bench import PROFILES

PROFILE = ProfileCost.from_file(PROFILES / "h200-qwen3-8b.json")


def _sched(num_slots=4, spec_mode="spec", num_blocks=400):
    cfg = SchedulerConfig(max_concurrency=num_slots, spec_mode=spec_mode, block_size=4)
    return Scheduler(cfg, num_blocks, CostModel(PROFILE))


def _spec(req_id, max_tokens=40):
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=tuple(range(10, 19)),
        sampling=SamplingSpec(),
        max_tokens=max_tokens,
    )


def _sim(num_slots):
    return SimExecutor(PROFILE, load_cohorts(PROFILES / "acceptance.json")["code"], num_slots)


def test_plan_views_agree_with_the_columns_and_results_keep_plan_order():
    sched, ex = _sched(), _sim(4)
    for i in range(4):
        sched.add_request(_spec(i))
    seen_spec = False
    for _ in range(12):
        plan = sched.plan(0.0)
        reqs = plan.reqs
        dec = plan.decode
        assert len(reqs) == plan.num_reqs == len(plan.route)
        assert [q.req_id for q in reqs[: len(dec)]] == dec.req_ids.tolist()
        assert all(q.mode == Mode.PREFILL for q in reqs[len(dec) :])
        assert plan.num_rows == sum(q.num_new for q in reqs)
        for q, letter in zip(reqs, plan.route):
            assert letter == {Mode.PREFILL: "P", Mode.AR: "A", Mode.SPEC: "S"}[q.mode]
            assert q.block_offset + len(q.new_block_ids) == sched.kv.num_blocks_of(q.req_id)
        assert not dec.num_draft.flags.writeable and not dec.slots.flags.writeable
        seen_spec |= bool(dec.num_draft.any())
        result = ex.run(plan)
        assert result.out.req_ids.tolist() == [q.req_id for q in reqs]
        deltas = sched.update(result, 0.0)
        assert [d.req_id for d in deltas] == deltas.req_ids.tolist()
    assert seen_spec


def test_a_stop_after_update_truncates_and_drops_the_round_in_flight():
    sched, ex = _sched(num_slots=2), _sim(2)
    sched.add_request(_spec(0))
    sched.add_request(_spec(1))
    outputs = {0: [], 1: []}
    for _ in range(4):
        for d in sched.update(ex.run(sched.plan(0.0)), 0.0):
            outputs[d.req_id] += d.token_ids
    assert len(outputs[0]) >= 3
    # round N's tokens are out; round N+1 is planned (in flight) when the stop is found
    in_flight = sched.plan(0.0)
    assert 0 in in_flight.decode.req_ids.tolist()
    keep = len(outputs[0]) - 1
    sched.stop(0, keep, "STOP")
    deltas = sched.update(ex.run(in_flight), 0.0)
    assert 0 not in deltas.req_ids.tolist()  # its tokens of the round in flight are dropped
    assert sched.request_state(0) == ReqState.FINISHED
    nxt = sched.plan(0.0)
    assert 0 not in [q.req_id for q in nxt.reqs]
    assert nxt.release  # its slot goes back in this plan
    assert not sched.kv.holds(0)
    sched.update(ex.run(nxt), 0.0)
    sched.kv.check()


@pytest.mark.parametrize("spec_mode", ["spec", "ar", "adaptive"])
def test_pool_returns_to_idle_with_columns_and_stops(spec_mode):
    sched, ex = _sched(num_slots=3, spec_mode=spec_mode, num_blocks=60), _sim(3)
    for i in range(8):
        sched.add_request(_spec(i, max_tokens=5 + 3 * i))
    finished = set()
    rounds = 0
    while sched.has_work():
        rounds += 1
        assert rounds < 500
        deltas = sched.update(ex.run(sched.plan(0.0)), 0.0)
        for i, (reason, _) in deltas.finish.items():
            finished.add(int(deltas.req_ids[i]))
            assert reason == "length"
        sched.kv.check()
    assert finished == set(range(8))
    assert sched.kv.num_free == sched.kv.num_total and sched.num_free_slots == 3


def test_result_rows_out_of_plan_order_are_refused():
    sched, ex = _sched(), _sim(4)
    for i in range(2):
        sched.add_request(_spec(i))
    for _ in range(3):
        sched.update(ex.run(sched.plan(0.0)), 0.0)
    plan = sched.plan(0.0)
    assert len(plan.decode) == 2
    swapped = Emitted.from_results(ex.run(plan).reqs[::-1])
    bad = RoundResult(
        round_id=plan.round_id,
        out=swapped,
        timings=PhaseTimes(),
        num_rows=0,
        num_padded_rows=0,
        num_kv_tokens=0,
    )
    with pytest.raises(ValueError, match="plan order"):
        sched.update(bad, 0.0)


def test_from_reqs_round_trips_a_plan():
    sched = _sched()
    for i in range(3):
        sched.add_request(_spec(i))
    ex = _sim(4)
    for _ in range(4):
        plan = sched.plan(0.0)
        again = RoundPlan.from_reqs(plan.reqs, round_id=plan.round_id)
        assert again.reqs == plan.reqs
        for a, b in zip(again.decode.__struct_fields__, plan.decode.__struct_fields__):
            assert np.array_equal(getattr(again.decode, a), getattr(plan.decode, b))
        sched.update(ex.run(plan), 0.0)
