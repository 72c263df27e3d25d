"""Percentiles, SLO goodput, per-tenant throughput and Jain's fairness index."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.records import RequestRecord
from loadtests.stats import (
    goodput,
    jain_index,
    meets_slo,
    parse_slo,
    per_tenant_tokens_per_s,
    percentile,
    summarize,
)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def test_percentile_edges_and_summary_units():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    s = summarize([0.010, 0.020, 0.030])
    assert s["n"] == 3
    assert s["p50_ms"] == pytest.approx(20.0)
    assert s["mean_ms"] == pytest.approx(20.0)
    assert s["max_ms"] == pytest.approx(30.0)
    assert summarize([])["p99_ms"] is None


def test_jain_index_bounds():
    assert jain_index([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain_index([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)
    assert jain_index([0.0, 0.0]) == 1.0
    assert jain_index([]) is None


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=20))
def test_jain_index_between_1_over_n_and_1(values):
    j = jain_index(values)
    assert 1 / len(values) - 1e-9 <= j <= 1 + 1e-9


def rec(req_id, tenant, ttft, tpot, n=11, error=""):
    times = tuple(ttft + i * tpot for i in range(n))
    return RequestRecord(
        req_id=req_id, tenant=tenant, submit_s=0.0, end_s=times[-1], chunk_times_s=times,
        chunk_tokens=(1,) * n, num_output_tokens=n, error=error,
    )  # fmt: skip


def test_slo_parsing_and_goodput():
    slo = parse_slo("ttft:100, tpot:20")
    assert slo == {"ttft": 0.1, "tpot": 0.02}
    for bad in ("ttft", "latency:5", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    fast = rec(0, "a", 0.05, 0.01)
    slow_start = rec(1, "a", 0.5, 0.01)
    slow_decode = rec(2, "b", 0.05, 0.05)
    failed = rec(3, "b", 0.05, 0.01, error="HTTP 503: busy")
    assert meets_slo(fast, slo) and not meets_slo(slow_start, slo)
    assert not meets_slo(slow_decode, slo) and not meets_slo(failed, slo)
    assert rec(4, "a", 0.05, 0.01).tpot_s == pytest.approx(0.01)
    g = goodput([fast, slow_start, slow_decode, failed], slo, duration_s=2.0)
    assert (g.num_good, g.good_fraction, g.requests_per_s) == (1, 0.25, 0.5)


def test_per_tenant_throughput_skips_failures():
    records = [rec(0, "a", 0.1, 0.01, n=10), rec(1, "b", 0.1, 0.01, n=30),
               rec(2, "b", 0.1, 0.01, n=50, error="x")]  # fmt: skip
    assert per_tenant_tokens_per_s(records, 10.0) == {"a": 1.0, "b": 3.0}
