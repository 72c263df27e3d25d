"""The speculation decision made ahead (`Scheduler.prepare_decision`, called while the device
runs a round): used only for an unchanged decoding set, never changes outputs, and leaves the
resources exactly as a plain run does."""

from __future__ import annotations

import msgspec

from scheduler.cost_model import CostModel
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.executor import SimExecutor
from tests.scheduler.test_lifecycle_invariants import PROFILE
from tests.scheduler.test_policy import specs

MIXED = (
    AcceptanceClass(0.5, 0.9, 0.5, 0.05, 0.1),
    AcceptanceClass(0.5, 0.6, 0.2, 0.05, 0.1),
)


def run(ahead: bool, num_slots: int = 6, num_requests: int = 14, seed: int = 1):
    cfg = SchedulerConfig(max_concurrency=num_slots, spec_mode="adaptive", spec_depth=8)
    sched = Scheduler(cfg, 4000, CostModel(PROFILE))
    ex = SimExecutor(PROFILE, MIXED, num_slots, seed=seed)
    # different lengths: requests finish at different rounds and waiting ones take their slots
    for i, spec in enumerate(specs(num_requests, max_tokens=40)):
        sched.add_request(msgspec.structs.replace(spec, max_tokens=20 + 7 * i))
    outputs: dict[int, list[int]] = {}
    reasons, sets = [], []
    now = 0.0
    while sched.has_work():
        plan = sched.plan(now)
        reasons.append(plan.reason)
        sets.append((tuple(plan.decode.req_ids.tolist()), len(plan.prefills)))
        if ahead:
            sched.prepare_decision()  # what the engine does while the device runs the round
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        for d in sched.update(result, now):
            outputs.setdefault(d.req_id, []).extend(d.token_ids)
    assert sched.kv.num_free == sched.kv.num_total
    assert sched.num_running == 0 and sched.num_waiting == 0
    return outputs, reasons, sets


def test_decision_ahead_is_used_only_for_an_unchanged_decoding_set():
    _, reasons, sets = run(ahead=True)
    ahead = [i for i, r in enumerate(reasons) if r.endswith("(ahead)")]
    assert len(ahead) > len(reasons) // 3  # steady stretches use it
    for i in ahead:
        # the round before decoded the same requests and neither round had a prefill chunk
        assert i > 0 and sets[i][0] == sets[i - 1][0] and sets[i][1] == 0 == sets[i - 1][1]
    # every change of the decoding set is decided afresh
    changed = [i for i in range(1, len(sets)) if sets[i][0] != sets[i - 1][0]]
    assert changed and not set(changed) & set(ahead)


def test_decision_ahead_changes_no_output():
    with_ahead, _, _ = run(ahead=True)
    plain, _, _ = run(ahead=False)
    assert with_ahead == plain  # the simulator's tokens are a function of (request, index)
    assert all(len(v) == 20 + 7 * k for k, v in sorted(plain.items()))
