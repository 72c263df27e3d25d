"""What every load run shares: settings read from the command line, the HTTP client, the
report's header, and one measured run (the server's `/metrics` scraped before and after it, a
progress bar, and a clock that starts with the run)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from loadtests.client import ClientConfig, detect_model
from loadtests.progress import Progress
from loadtests.records import RequestRecord
from loadtests.runners import Tenant, parse_tenants
from loadtests.server_metrics import metrics_url, scrape, summarize_delta
from loadtests.stats import parse_slo

Clock = Callable[[], float]
OnDone = Callable[[RequestRecord], None]


@dataclass(frozen=True)
class Settings:
    tenants: tuple[Tenant, ...]
    slo: dict[str, float] | None  # seconds
    extra_body: dict
    metrics_url: str  # empty: no scrape


def settings_from(args: argparse.Namespace) -> Settings:
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    murl = "" if args.metrics_url == "none" else (args.metrics_url or metrics_url(args.base_url))
    return Settings(
        tenants=parse_tenants(args.api_key),
        slo=parse_slo(args.slo) if args.slo else None,
        extra_body=extra,
        metrics_url=murl,
    )


def http_client(args: argparse.Namespace) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits)


async def client_config(
    http: httpx.AsyncClient, args: argparse.Namespace, settings: Settings, endpoint: str
) -> ClientConfig:
    model = args.model or await detect_model(http, args.base_url, settings.tenants[0].api_key)
    return ClientConfig(
        base_url=args.base_url, model=model, endpoint=endpoint, max_tokens=args.max_tokens,
        temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=settings.extra_body,
    )  # fmt: skip


def report_header(args: argparse.Namespace, settings: Settings, mode: str, label: str) -> dict:
    slo = settings.slo
    return {
        "tool": "hipfire-loadgen",
        "version": 1,
        "label": args.label or label,
        "mode": mode,
        "created_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "tenants": [t.name for t in settings.tenants],
        "slo_ms": {k: v * 1e3 for k, v in slo.items()} if slo else None,
        "runs": [],
    }


async def _settled_after(http, url, before, num_ok):
    """Scrape after a run; servers may count a request just after its stream closed, so wait
    (briefly) until the success counter covers every request the run saw succeed."""
    after = await scrape(http, url)
    deadline = time.monotonic() + 3.0
    while after is not None and before is not None and time.monotonic() < deadline:
        delta = summarize_delta(before, after)
        if delta is None or delta["requests_succeeded"] >= num_ok:
            break
        await asyncio.sleep(0.1)
        after = await scrape(http, url)
    return after


async def measured_run(
    http: httpx.AsyncClient,
    settings: Settings,
    args: argparse.Namespace,
    num_requests: int,
    title: str,
    run: Callable[[Clock, OnDone], Awaitable[list[RequestRecord]]],
) -> tuple[list[RequestRecord], dict | None]:
    """The run's records and the server's counter deltas over it (None without metrics)."""
    murl = settings.metrics_url
    before = await scrape(http, murl) if murl else None
    progress = Progress(num_requests, title, enabled=args.progress and sys.stderr.isatty())
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    records = await run(clock, progress.update)
    progress.close()
    num_ok = sum(r.ok for r in records)
    after = await _settled_after(http, murl, before, num_ok) if murl else None
    return records, summarize_delta(before, after)
