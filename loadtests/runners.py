"""The two load shapes: closed-loop refill at fixed concurrency, and open-loop arrivals.

refill:  C request slots; whenever a stream ends, that slot submits the next request at once,
         until the planned requests (waves * C) are used up. The run then drains: the last
         requests finish with fewer than C live, which is what the finite refill rate includes
         and the full-live rate leaves out (see windows.py).
poisson: requests arrive at `rate` per second regardless of how fast the server answers. Gaps are
         gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson
         process, below 1 burstier, above 1 more regular. An optional cap bounds the number of
         requests in flight (arrivals beyond it wait for a free slot).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from loadtests.client import ClientConfig, PlannedRequest, stream_request
from loadtests.prompts import Prompt, seeded_order
from loadtests.records import RequestRecord

OnDone = Callable[[RequestRecord], None]


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str | None


def parse_tenants(keys: Sequence[str]) -> tuple[Tenant, ...]:
    """'KEY' or 'NAME=KEY' per entry; no keys means one anonymous tenant."""
    if not keys:
        return (Tenant("default", None),)
    tenants = []
    for i, entry in enumerate(keys):
        name, sep, key = entry.partition("=")
        tenants.append(Tenant(name, key) if sep else Tenant(f"tenant{i}", entry))
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError("tenant names must be unique")
    return tuple(tenants)


def plan_requests(
    prompts: list[Prompt], num_requests: int, tenants: Sequence[Tenant], seed: int
) -> list[PlannedRequest]:
    """Deterministic requests: seeded prompt order, tenants taken in turn, one seed each."""
    return [
        PlannedRequest(
            req_id=i,
            prompt_id=p.prompt_id,
            prompt=p.prompt,
            messages=p.messages,
            tenant=tenants[i % len(tenants)].name,
            api_key=tenants[i % len(tenants)].api_key,
            seed=seed + i,
        )
        for i, p in enumerate(seeded_order(prompts, num_requests, seed))
    ]


async def run_refill(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    requests: Sequence[PlannedRequest],
    concurrency: int,
    clock: Callable[[], float],
    on_done: OnDone,
) -> list[RequestRecord]:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = iter(requests)
    records: list[RequestRecord] = []

    async def slot() -> None:
        # Taking the next request and submitting it happen with no await in between, so a
        # freed slot refills at once and no two slots take the same request.
        for req in pending:
            record = await stream_request(http, cfg, req, clock)
            records.append(record)
            on_done(record)

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.req_id)


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (s) of each arrival from the run start; the first request arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times


async def run_poisson(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    requests: Sequence[PlannedRequest],
    rate: float,
    burstiness: float,
    seed: int,
    clock: Callable[[], float],
    on_done: OnDone,
    max_in_flight: int | None = None,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    async def one(req: PlannedRequest) -> None:
        if gate is None:
            record = await stream_request(http, cfg, req, clock)
        else:
            async with gate:
                record = await stream_request(http, cfg, req, clock)
        records.append(record)
        on_done(record)

    tasks = []
    start = clock()
    for req, offset in zip(requests, arrival_times(len(requests), rate, burstiness, seed)):
        delay = start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.req_id)
