"""Latency percentiles, SLO goodput and Jain's fairness index."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtests.records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default 'linear' method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max (seconds in, milliseconds out), plus the sample count."""
    vals = list(values)
    out: dict[str, float | None] = {"n": len(vals)}
    out["mean_ms"] = 1e3 * sum(vals) / len(vals) if vals else None
    for q in PERCENTILES:
        p = percentile(vals, q)
        out[f"p{q}_ms"] = None if p is None else 1e3 * p
    out["max_ms"] = 1e3 * max(vals) if vals else None
    return out


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one takes all."""
    if not values:
        return None
    sq = sum(v * v for v in values)
    if sq == 0:
        return 1.0  # nobody got anything: equally (un)served
    return sum(values) ** 2 / (len(values) * sq)


SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 0.5, 'tpot': 0.05} (milliseconds in, seconds out)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
        slo[key] = ms / 1e3
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A request is good when it succeeded and every given bound holds. A request with a single
    output token has no TPOT; the TPOT bound does not apply to it."""
    if not record.ok:
        return False
    checks = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    return all(checks[k] is None or checks[k] <= bound for k, bound in slo.items())


@dataclass(frozen=True)
class Goodput:
    num_good: int
    good_fraction: float
    requests_per_s: float  # good requests over the run's duration


def goodput(records: Sequence[RequestRecord], slo: dict[str, float], duration_s: float) -> Goodput:
    num_good = sum(meets_slo(r, slo) for r in records)
    return Goodput(
        num_good=num_good,
        good_fraction=num_good / len(records) if records else 0.0,
        requests_per_s=num_good / duration_s if duration_s > 0 else 0.0,
    )


def per_tenant_tokens_per_s(
    records: Sequence[RequestRecord], duration_s: float
) -> dict[str, float]:
    tokens: dict[str, int] = {}
    for r in records:
        tokens[r.tenant] = tokens.get(r.tenant, 0) + (r.num_output_tokens if r.ok else 0)
    return {t: (n / duration_s if duration_s > 0 else 0.0) for t, n in sorted(tokens.items())}
