"""Tenant-fair admission: weighted slot-time shares, caps, priorities, Jain's index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.plan import SamplingSpec
from scheduler.request import Request, RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.executor import SimExecutor
from scheduler.tenants import FairAdmission, TenantSpec, jain_index
from tests.scheduler.test_lifecycle_invariants import PROFILE

FLAT = (AcceptanceClass(1.0, 0.8, 0.8, 0.0, 0.0),)


def _spec(req_id, tenant, max_tokens, prompt_len=8):
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=tuple(range(100, 100 + prompt_len)),
        sampling=SamplingSpec(),
        max_tokens=max_tokens,
        tenant=tenant,
    )


def run_saturated(tenants, concurrency, lengths, num_rounds, seed=0):
    """Every tenant always has a backlog; returns slot-seconds per tenant and the max live
    count seen per tenant."""
    cfg = SchedulerConfig(max_concurrency=concurrency, spec_mode="ar", max_queue=100_000)
    sched = Scheduler(cfg, num_kv_blocks=4096, tenants=tenants)
    ex = SimExecutor(PROFILE, FLAT, concurrency, seed=seed, noise_sigma=0.0)
    next_id = 0
    per_tenant_backlog = 3 * concurrency
    for t in tenants:
        for _ in range(per_tenant_backlog):
            sched.add_request(_spec(next_id, t.name, lengths[next_id % len(lengths)]))
            next_id += 1
    tenant_of = {}
    max_live = dict.fromkeys((t.name for t in tenants), 0)
    now = 0.0
    for _ in range(num_rounds):
        plan = sched.plan(now)
        live = {}
        for r in sched._live:
            live[r.spec.tenant] = live.get(r.spec.tenant, 0) + 1
            tenant_of[r.req_id] = r.spec.tenant
        for name, count in live.items():
            max_live[name] = max(max_live[name], count)
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        for d in sched.update(result, now):
            if d.finish_reason:  # keep every tenant backlogged
                tenant = tenant_of[d.req_id]
                sched.add_request(_spec(next_id, tenant, lengths[next_id % len(lengths)]))
                next_id += 1
    return sched.admission.slot_seconds(), max_live


@settings(max_examples=6, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=3),
    concurrency=st.integers(6, 12),
    lengths=st.lists(st.integers(2, 24), min_size=3, max_size=6),
)
def test_weighted_shares_within_ten_percent(weights, concurrency, lengths):
    tenants = [TenantSpec(f"t{i}", w) for i, w in enumerate(weights)]
    seconds, _ = run_saturated(tenants, concurrency, lengths, num_rounds=500)
    total = sum(seconds[t.name] for t in tenants)
    for t in tenants:
        share = seconds[t.name] / total
        want = t.weight / sum(weights)
        assert abs(share - want) <= 0.1 * want, (t.name, share, want)
    assert jain_index([seconds[t.name] / t.weight for t in tenants]) > 0.99


def test_capped_tenant_waits_without_blocking_others():
    tenants = [TenantSpec("capped", 4.0, max_concurrency=1), TenantSpec("a"), TenantSpec("b")]
    seconds, max_live = run_saturated(tenants, 6, [5, 9, 13], num_rounds=400)
    assert max_live["capped"] == 1
    # the other two share the remaining 5 slots equally
    assert seconds["a"] == pytest.approx(seconds["b"], rel=0.1)
    assert seconds["a"] > 2 * seconds["capped"]


def test_priority_first_then_weights():
    adm = FairAdmission([TenantSpec("low", 10.0), TenantSpec("high", 1.0, priority=1)])
    low = Request(_spec(1, "low", 4))
    high = Request(_spec(2, "high", 4))
    adm.push(low)
    adm.push(high)
    assert adm.peek() is high
    adm.pop(high)
    assert adm.peek() is low


def test_idle_tenant_does_not_bank_credit():
    adm = FairAdmission([TenantSpec("busy"), TenantSpec("idle")])
    for i in range(20):
        adm.push(Request(_spec(i, "busy", 4)))
    adm.pop(adm.peek())
    for _ in range(100):
        adm.charge(1.0)  # busy holds a slot for 100 s while idle has nothing queued
    for i in range(20, 40):
        adm.push(Request(_spec(i, "idle", 4)))
    # idle re-enters at busy's virtual time, not 100 s behind: the two now alternate
    # instead of idle taking the next 100 slot-seconds alone
    admitted = []
    for _ in range(10):
        req = adm.peek()
        adm.pop(req)
        admitted.append(req.spec.tenant)
        adm.charge(1.0)
    assert 4 <= admitted.count("idle") <= 6


def test_unknown_tenant_gets_default_share_and_bad_specs_rejected():
    adm = FairAdmission([TenantSpec("a")])
    assert adm.tenant_spec("nobody").weight == 1.0
    with pytest.raises(ValueError):
        TenantSpec("x", weight=0)
    with pytest.raises(ValueError):
        FairAdmission([TenantSpec("a"), TenantSpec("a")])


def test_jain_index_bounds():
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert 0.25 < jain_index([3.0, 1.0, 1.0, 1.0]) < 1.0
