"""Runs a grid of simulations (policy x cohort x concurrency), in parallel processes."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scheduler.cost_model import ProfileCost
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.runner import SimSetup, Workload, run_sim


@dataclass(frozen=True)
class GridPoint:
    profile_path: str
    acceptance_path: str
    cohort: str
    setup: SimSetup
    workload: Workload


def requests_for(concurrency: int, num_requests: int) -> int:
    """0 asks for the default: three waves of C, at least 16 requests."""
    return num_requests if num_requests > 0 else max(16, 3 * concurrency)


def _run_point(point: GridPoint) -> dict:
    profile = ProfileCost.from_file(point.profile_path)
    classes = load_cohorts(point.acceptance_path)[point.cohort]
    result = run_sim(profile, classes, point.setup, point.workload)
    row = dataclasses.asdict(result)
    row["cohort"] = point.cohort
    row["num_requests"] = point.workload.num_requests
    return row


def run_grid(
    profile_path: str | Path,
    acceptance_path: str | Path,
    cohorts: list[str],
    concurrencies: list[int],
    policies: list[str],
    *,
    num_requests: int = 0,
    max_tokens: int = 512,
    prompt_len: int = 128,
    spec_depth: int = 8,
    seed: int = 0,
    workload: str = "refill",
    arrival_rate: float = 0.0,
    noise_sigma: float = 0.03,
    num_workers: int = 0,
    decide_ahead: bool = False,
) -> list[dict]:
    known = load_cohorts(acceptance_path)
    for cohort in cohorts:
        if cohort not in known:
            raise ValueError(f"cohort {cohort!r} not in {acceptance_path} ({', '.join(known)})")
    points = [
        GridPoint(
            str(profile_path),
            str(acceptance_path),
            cohort,
            SimSetup(
                policy=policy,
                concurrency=c,
                spec_depth=spec_depth,
                seed=seed,
                noise_sigma=noise_sigma,
                decide_ahead=decide_ahead,
            ),
            Workload(
                kind=workload,
                num_requests=requests_for(c, num_requests),
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                arrival_rate=arrival_rate,
            ),
        )
        for cohort in cohorts
        for c in concurrencies
        for policy in policies
    ]
    # largest first: the long runs start early and the pool stays busy
    order = sorted(range(len(points)), key=lambda i: -points[i].setup.concurrency)
    workers = num_workers or os.cpu_count() or 1
    rows: list[dict | None] = [None] * len(points)
    if workers == 1:
        for i in order:
            rows[i] = _run_point(points[i])
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for i, row in zip(order, pool.map(_run_point, [points[i] for i in order])):
                rows[i] = row
    return [r for r in rows if r is not None]
