"""The scheduler's observability: running totals kept by its parts, and the snapshot of them and
of the last plan that `Scheduler.stats` hands out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from scheduler.plan import RoundPlan
from scheduler.request import ReqState, Request

if TYPE_CHECKING:
    from scheduler.kv_blocks import BlockPool
    from scheduler.prefix_cache import PrefixCache


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True):
    round_id: int
    num_running: int
    num_waiting: int
    num_prefilling: int
    num_decoding: int
    kv_usage: float
    route: str
    num_spec: int  # k: speculating requests in the last round
    spec_depth: int  # deepest chain of the last round (rows per spec request)
    predicted_ms: float
    measured_ms: float
    reason: str
    num_policy_switches: int  # requests that changed AR <-> SPEC, total
    num_preemptions: int
    num_drafted: int
    num_accepted: int
    # prefix caching: context tokens looked up at admission and those found cached, per tenant
    # (requests resumed after preemption apart); blocks cached now, of which nobody holds some
    enable_prefix_caching: bool = False
    prefix_cache_queries: dict[str, int] = msgspec.field(default_factory=dict)
    prefix_cache_hits: dict[str, int] = msgspec.field(default_factory=dict)
    prefix_cache_resumed_queries: int = 0
    prefix_cache_resumed_hits: int = 0
    num_cached_blocks: int = 0
    num_evictable_blocks: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0  # free or evictable


@dataclass
class SchedulerCounters:
    """Totals since the scheduler started, each advanced by the part that sees the event."""

    num_switches: int = 0  # requests that changed AR <-> SPEC (the round builder)
    num_preemptions: int = 0  # (KV reservation, through the lifecycle)
    num_drafted: int = 0  # drafts of live speculating requests (applying results)
    num_accepted: int = 0
    measured_ms: float = 0.0  # the last result's round time


def snapshot(
    round_id: int,
    live: list[Request],
    num_waiting: int,
    kv: BlockPool,
    last_plan: RoundPlan | None,
    counters: SchedulerCounters,
    prefix_cache: PrefixCache,
) -> SchedulerStats:
    plan = last_plan
    cached = prefix_cache.counters
    return SchedulerStats(
        round_id=round_id,
        num_running=len(live),
        num_waiting=num_waiting,
        num_prefilling=sum(1 for r in live if r.state == ReqState.PREFILLING),
        num_decoding=sum(1 for r in live if r.state == ReqState.DECODING),
        kv_usage=kv.usage,
        route=plan.route if plan else "",
        num_spec=plan.route.count("S") if plan else 0,
        spec_depth=plan.spec_depth if plan else 1,
        predicted_ms=plan.predicted_ms if plan else 0.0,
        measured_ms=counters.measured_ms,
        reason=plan.reason if plan else "",
        num_policy_switches=counters.num_switches,
        num_preemptions=counters.num_preemptions,
        num_drafted=counters.num_drafted,
        num_accepted=counters.num_accepted,
        enable_prefix_caching=prefix_cache.enabled,
        prefix_cache_queries=dict(cached.queries),
        prefix_cache_hits=dict(cached.hits),
        prefix_cache_resumed_queries=cached.resumed_queries,
        prefix_cache_resumed_hits=cached.resumed_hits,
        num_cached_blocks=kv.num_cached,
        num_evictable_blocks=kv.num_evictable,
        num_kv_blocks=kv.num_total,
        num_free_kv_blocks=kv.num_free,
    )
