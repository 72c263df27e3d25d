"""Tenant-fair admission: which waiting request gets the next free slot.

Policy (documented in docs/architecture.md, "Scheduler"):
- Higher `priority` tenants are always admitted first; within one priority level the tenants
  share slots by weighted fair queuing on *slot-time*.
- Each tenant carries a virtual time `vtime = slot-seconds held / weight`. Every round charges
  each tenant `live_slots * round_seconds / weight`. The next slot goes to the backlogged tenant
  (waiting requests, under its cap) with the smallest vtime: the one furthest behind its share.
  This is least-attained-weighted-service, the slot analogue of start-time fair queuing.
  Equal vtimes go to the tenant with fewer live slots per weight.
- A tenant that was idle re-enters at `max(own vtime, smallest vtime of the active tenants)`, so
  idling does not bank credit that would later starve the others.
- A tenant at its `max_concurrency` is skipped (its requests wait) without blocking anyone else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from scheduler.request import Request


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: float = 1.0  # share of slot-time under contention, relative to the other tenants
    max_concurrency: int = 0  # live slots at most; 0: no cap beyond the server's
    priority: int = 0  # higher is admitted first; equal priorities share by weight

    def __post_init__(self):
        if self.weight <= 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.max_concurrency < 0:
            raise ValueError(f"tenant {self.name!r}: max_concurrency must be >= 0")


DEFAULT_TENANT = TenantSpec("default")


class _TenantState:
    __slots__ = ("num_live", "queue", "slot_seconds", "spec", "vtime")

    def __init__(self, spec: TenantSpec):
        self.spec = spec
        self.queue: deque[Request] = deque()
        self.num_live = 0
        self.vtime = 0.0  # slot-seconds / weight, shifted forward on re-entry
        self.slot_seconds = 0.0  # unshifted, for reporting shares

    @property
    def at_cap(self) -> bool:
        cap = self.spec.max_concurrency
        return cap > 0 and self.num_live >= cap


class FairAdmission:
    """Per-tenant FIFO queues plus the weighted-fair choice between tenants."""

    def __init__(self, tenants: Sequence[TenantSpec] = ()):
        self._tenants: dict[str, _TenantState] = {}
        for spec in tenants:
            if spec.name in self._tenants:
                raise ValueError(f"tenant {spec.name!r} is defined twice")
            self._tenants[spec.name] = _TenantState(spec)
        self.num_waiting = 0

    def _tenant(self, name: str) -> _TenantState:
        state = self._tenants.get(name)
        if state is None:  # unknown tenants get the default share
            state = _TenantState(TenantSpec(name))
            self._tenants[name] = state
        return state

    def tenant_spec(self, name: str) -> TenantSpec:
        return self._tenant(name).spec

    def _min_active_vtime(self, exclude: _TenantState) -> float | None:
        vtimes = [
            t.vtime for t in self._tenants.values() if t is not exclude and (t.queue or t.num_live)
        ]
        return min(vtimes) if vtimes else None

    def push(self, req: Request, front: bool = False) -> None:
        """Queues a request; `front` for a preempted one, which resumes before newer ones."""
        tenant = self._tenant(req.spec.tenant)
        if not tenant.queue and not tenant.num_live:
            floor = self._min_active_vtime(tenant)
            if floor is not None and floor > tenant.vtime:
                tenant.vtime = floor
        if front:
            tenant.queue.appendleft(req)
        else:
            tenant.queue.append(req)
        self.num_waiting += 1

    def remove(self, req: Request) -> bool:
        tenant = self._tenant(req.spec.tenant)
        try:
            tenant.queue.remove(req)
        except ValueError:
            return False
        self.num_waiting -= 1
        return True

    def peek(self) -> Request | None:
        """The request that would be admitted next (None when nobody may be admitted)."""
        best: _TenantState | None = None
        best_key: tuple[float, float, float] | None = None
        for tenant in self._tenants.values():
            if not tenant.queue or tenant.at_cap:
                continue
            # Equal virtual times (a fresh start, or tenants re-entering at the same floor) are
            # broken by live slots per weight: vtime only moves once a round is charged, so
            # without it one plan would hand every free slot to the first tenant of the tie.
            key = (-tenant.spec.priority, tenant.vtime, tenant.num_live / tenant.spec.weight)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best.queue[0] if best is not None else None

    def pop(self, req: Request) -> None:
        """Takes the request returned by peek() out of its queue and counts it live."""
        tenant = self._tenant(req.spec.tenant)
        popped = tenant.queue.popleft()
        assert popped is req, "pop() must follow peek()"
        tenant.num_live += 1
        self.num_waiting -= 1

    def on_release(self, tenant_name: str) -> None:
        self._tenant(tenant_name).num_live -= 1

    def charge(self, round_seconds: float) -> None:
        """Charges every tenant for the slots it held during a round."""
        for tenant in self._tenants.values():
            if tenant.num_live:
                held = tenant.num_live * round_seconds
                tenant.slot_seconds += held
                tenant.vtime += held / tenant.spec.weight

    def num_live(self, name: str) -> int:
        return self._tenant(name).num_live

    def slot_seconds(self) -> dict[str, float]:
        return {name: t.slot_seconds for name, t in self._tenants.items()}

    def waiting(self) -> Iterator[Request]:
        for tenant in self._tenants.values():
            yield from tenant.queue


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all.
    Pass per-tenant shares already divided by their weights."""
    if not values:
        return 1.0
    total = sum(values)
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0 else total * total / (len(values) * squares)
