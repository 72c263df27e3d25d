"""The speculation decision made ahead (`Scheduler.prepare_decision`, called while the device
runs a round): used only for an unchanged decoding set, never changes outputs, and leaves the
resources exactly as a plain run does."""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.policy import Decision
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


class _GreedyPolicy:
    """Asks for more drafts than allowed (even of requests that opt out, or one token from
    max_tokens), so only the caps plan() applies to a decision made ahead keep it valid."""

    name = "greedy"

    def __init__(self, depths):
        self.depths = depths

    def decide(self, view, estimator, cost_model):
        n = len(view.slots)
        return Decision(np.array([self.depths[i % len(self.depths)] for i in range(n)]), "fixed")


@given(
    depths=st.lists(st.integers(0, 10), min_size=1, max_size=4),
    max_tokens=st.lists(st.integers(8, 30), min_size=4, max_size=4),
    off=st.lists(st.booleans(), min_size=4, max_size=4),
)
@settings(max_examples=30, deadline=None)
def test_a_decision_ahead_is_capped_like_a_plain_one(depths, max_tokens, off):
    """Rounds decided ahead keep every depth within max_drafts, zero for requests that opt
    out, and below the tokens each request has left at plan time."""
    cfg = SchedulerConfig(max_concurrency=4, spec_mode="adaptive", spec_depth=6)
    sched = Scheduler(cfg, 400, CostModel(PROFILE), policy=_GreedyPolicy(depths))
    ex = SimExecutor(PROFILE, MIXED, 4, seed=0)
    for i, spec in enumerate(specs(4)):
        speculation = "off" if off[i] else "auto"
        sched.add_request(
            msgspec.structs.replace(spec, max_tokens=max_tokens[i], speculation=speculation)
        )
    emitted = dict.fromkeys(range(4), 0)
    num_ahead = 0
    while sched.has_work():
        plan = sched.plan(0.0)
        if plan.reason.endswith("(ahead)"):
            num_ahead += 1
            dec = plan.decode
            for req_id, num_draft in zip(dec.req_ids.tolist(), dec.num_draft.tolist()):
                assert num_draft <= cfg.max_drafts
                assert num_draft == 0 or not off[req_id]
                assert num_draft <= max_tokens[req_id] - emitted[req_id] - 1
        sched.prepare_decision()
        for d in sched.update(ex.run(plan), 0.0):
            emitted[d.req_id] += len(d.token_ids)
    assert num_ahead > 0
