"""`hipfire-loadgen compare A.json B.json ...`: the same runs of several reports side by side.

Runs are matched by their key (C for refill and multi-turn, rate for poisson). Each metric is
shown for every report and as a ratio to the first report (the baseline), e.g. an adaptive
server against always-AR and always-spec ones, or prefix caching on against off. For
latencies a ratio below 1 is better, for throughput above.
"""

from __future__ import annotations

from collections.abc import Sequence

from loadtests.results import dig
from loadtests.table import fmt, render, run_key

METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("full-live tok/s", ("full_live_tokens_per_s",)),
    ("refill tok/s", ("refill_tokens_per_s",)),
    ("req/s", ("requests_per_s",)),
    ("TTFT p50 ms", ("ttft", "p50_ms")),
    ("TTFT p90 ms", ("ttft", "p90_ms")),
    ("TTFT p99 ms", ("ttft", "p99_ms")),
    ("TTFT first p50 ms", ("ttft_split", "first", "ttft", "p50_ms")),
    ("TTFT later p50 ms", ("ttft_split", "later", "ttft", "p50_ms")),
    ("ITL p50 ms", ("itl", "p50_ms")),
    ("TPOT p50 ms", ("tpot", "p50_ms")),
    ("E2E p99 ms", ("e2e", "p99_ms")),
    ("goodput req/s", ("goodput", "requests_per_s")),
    ("accept len", ("server", "acceptance_length")),
    ("prefix hit rate", ("server", "prefix_cache_hit_rate")),
)


def compare_table(reports: Sequence[dict]) -> str:
    if len(reports) < 2:
        raise ValueError("compare needs at least two reports")
    labels = [r["label"] for r in reports]
    if len(set(labels)) != len(labels):
        labels = [f"{label}#{i}" for i, label in enumerate(labels)]
    by_key = [{run_key(run): run for run in r["runs"]} for r in reports]
    keys = [k for k in by_key[0] if all(k in runs for runs in by_key[1:])]
    if not keys:
        raise ValueError("the reports share no run (match refill C or poisson rate)")
    headers = ["run", "metric", *labels, *(f"{lbl}/{labels[0]}" for lbl in labels[1:])]
    rows = []
    for key in keys:
        for name, path in METRICS:
            values = [dig(runs[key], path) for runs in by_key]
            if all(v is None for v in values):
                continue
            base = values[0]
            ratios = [
                f"x{v / base:.2f}" if v is not None and base not in (None, 0) else "-"
                for v in values[1:]
            ]
            digits = 2 if name in ("accept len", "prefix hit rate") else 1
            rows.append([key, name, *(fmt(v, digits) for v in values), *ratios])
    return render(headers, rows)
