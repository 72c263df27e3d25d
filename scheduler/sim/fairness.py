"""Tenant fairness under saturation: every tenant always has a backlog, the slots are shared by
weighted fair admission, and each tenant's slot-time share is compared with its weight."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.cost_model import ProfileCost
from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.executor import SimExecutor
from scheduler.tenants import TenantSpec, jain_index

FLAT = (AcceptanceClass(1.0, 0.8, 0.8, 0.0, 0.0),)


def run_saturated(
    profile: ProfileCost,
    tenants: Sequence[TenantSpec],
    concurrency: int,
    lengths: Sequence[int],
    num_rounds: int,
    spec_mode: str = "ar",
    classes: tuple[AcceptanceClass, ...] = FLAT,
    seed: int = 0,
) -> dict:
    """Returns slot-seconds per tenant, the most live slots each held, weighted shares and
    Jain's index over slot-seconds / weight. Request i generates lengths[i % len(lengths)]."""
    cfg = SchedulerConfig(max_concurrency=concurrency, spec_mode=spec_mode, max_queue=1 << 20)
    sched = Scheduler(cfg, num_kv_blocks=concurrency * 64 + 64, tenants=tenants)
    ex = SimExecutor(profile, classes, concurrency, seed=seed, noise_sigma=0.0)
    next_id = 0

    tenant_of: dict[int, str] = {}

    def submit(tenant: str) -> None:
        nonlocal next_id
        tenant_of[next_id] = tenant
        sched.add_request(
            RequestSpec(
                req_id=next_id,
                prompt_token_ids=tuple(range(100, 108)),
                sampling=SamplingSpec(),
                max_tokens=lengths[next_id % len(lengths)],
                tenant=tenant,
            )
        )
        next_id += 1

    for t in tenants:
        for _ in range(3 * concurrency):
            submit(t.name)
    max_live = dict.fromkeys((t.name for t in tenants), 0)
    now = 0.0
    for _ in range(num_rounds):
        plan = sched.plan(now)
        live: dict[str, int] = {}
        for name in max_live:
            live[name] = sched.admission.num_live(name)
            max_live[name] = max(max_live[name], live[name])
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        for d in sched.update(result, now):
            if d.finish_reason:  # replace it: every tenant stays backlogged
                submit(tenant_of.pop(d.req_id))
    seconds = sched.admission.slot_seconds()
    total = sum(seconds[t.name] for t in tenants) or 1.0
    weight_sum = sum(t.weight for t in tenants)
    return {
        "slot_seconds": {t.name: seconds[t.name] for t in tenants},
        "share": {t.name: seconds[t.name] / total for t in tenants},
        "weight_share": {t.name: t.weight / weight_sum for t in tenants},
        "max_live": max_live,
        "jain_index": jain_index([seconds[t.name] / t.weight for t in tenants]),
    }
