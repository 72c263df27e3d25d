"""Full-live windows, drain and refill throughput on synthetic stream timelines."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.records import RequestRecord
from loadtests.windows import (
    full_live_windows,
    throughput,
    tokens_in_windows,
    tokens_per_s_over_time,
)


def rec(req_id, submit, times, tokens=None, end=None, error=""):
    tokens = tokens or [1] * len(times)
    return RequestRecord(
        req_id=req_id,
        tenant="t",
        submit_s=submit,
        end_s=end if end is not None else (times[-1] if times else submit),
        chunk_times_s=tuple(times),
        chunk_tokens=tuple(tokens),
        num_output_tokens=sum(tokens),
        error=error,
    )


def steady(req_id, submit, first, num_tokens, step):
    return rec(req_id, submit, [first + i * step for i in range(num_tokens)])


def test_two_slots_refill_with_drain():
    # C=2. A: decodes 1..5, B: decodes 2..4, C (refills B's slot): decodes 4.5..8.
    # Both slots decode in [2, 4] and [4.5, 5]; the drain after 5 (only C left) is excluded.
    a = steady(0, 0.0, 1.0, 9, 0.5)  # tokens at 1.0, 1.5, ..., 5.0
    b = steady(1, 0.0, 2.0, 5, 0.5)  # 2.0 .. 4.0
    c = steady(2, 4.0, 4.5, 8, 0.5)  # 4.5 .. 8.0
    records = [a, b, c]
    windows = full_live_windows([(r.chunk_times_s[0], r.chunk_times_s[-1]) for r in records], 2)
    assert windows == [(2.0, 4.0), (4.5, 5.0)]
    # In (2, 4]: A at 2.5,3,3.5,4 and B at 2.5,3,3.5,4 -> 8. In (4.5, 5]: A at 5, C at 5 -> 2.
    assert tokens_in_windows(records, windows) == 10
    tp = throughput(records, 2)
    assert tp.full_live_s == pytest.approx(2.5)
    assert tp.full_live_tokens_per_s == pytest.approx(10 / 2.5)
    assert tp.num_output_tokens == 22
    assert tp.duration_s == pytest.approx(8.0)
    assert tp.refill_tokens_per_s == pytest.approx(22 / 8.0)
    assert tp.num_windows == 2


def test_single_slot_is_decode_rate_without_ttft():
    # C=1: each request's window is first..last token; the first token (a prefill product)
    # is not counted, so the rate is (n - 1) / decode time.
    a = steady(0, 0.0, 0.5, 11, 0.1)  # decode 0.5 .. 1.5
    b = steady(1, 1.5, 2.5, 11, 0.1)  # submitted when a ended, prefill 1.5 .. 2.5
    tp = throughput([a, b], 1)
    assert tp.full_live_s == pytest.approx(2.0)
    assert tp.full_live_tokens == 20
    assert tp.full_live_tokens_per_s == pytest.approx(10.0)
    assert tp.refill_tokens_per_s == pytest.approx(22 / 3.5)


def test_multi_token_chunks_count_all_their_tokens():
    a = rec(0, 0.0, [1.0, 2.0, 3.0], tokens=[1, 4, 3])
    b = rec(1, 0.0, [1.5, 2.5, 3.5], tokens=[1, 2, 5])
    tp = throughput([a, b], 2)
    assert (tp.full_live_s, tp.full_live_tokens) == (pytest.approx(1.5), 4 + 3 + 2)


def test_never_full_gives_no_full_live_rate():
    a = steady(0, 0.0, 1.0, 3, 1.0)  # 1..3
    b = steady(1, 3.0, 4.0, 3, 1.0)  # 4..6: never together with a
    tp = throughput([a, b], 2)
    assert tp.full_live_tokens_per_s is None
    assert tp.full_live_s == 0.0
    assert tp.refill_tokens_per_s == pytest.approx(6 / 6.0)


def test_touching_windows_merge_and_failed_requests_add_no_tokens():
    windows = full_live_windows([(0.0, 2.0), (1.0, 3.0), (2.0, 4.0)], 2)
    assert windows == [(1.0, 3.0)]  # at t=2 one ends as another starts: one window
    failed = rec(9, 0.0, [0.5, 1.0], error="HTTP 500: boom")
    assert throughput([failed], 1).num_output_tokens == 0


def test_bad_concurrency_is_refused():
    with pytest.raises(ValueError, match="concurrency"):
        full_live_windows([(0.0, 1.0)], 0)


def test_timeline_conserves_tokens():
    records = [steady(i, 0.0, 0.1 * i + 0.2, 10, 0.05) for i in range(4)]
    points = tokens_per_s_over_time(records, num_bins=20)
    width = points[1][0] - points[0][0]
    assert len(points) == 20
    assert sum(v * width for _, v in points) == pytest.approx(40)


intervals = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0.01, 50)).map(lambda t: (t[0], t[0] + t[1])),
    min_size=1,
    max_size=12,
)


@given(intervals, st.integers(1, 6))
def test_windows_have_exactly_c_or_more_live(spans, concurrency):
    """Property: inside every window at least C intervals are live, and just outside fewer are
    (windows are maximal); windows are disjoint and sorted."""
    windows = full_live_windows(spans, concurrency)

    def live(t):
        return sum(s <= t <= e for s, e in spans if e > s)

    for (_, e1), (s2, _) in itertools.pairwise(windows):
        assert e1 < s2
    for s, e in windows:
        assert e > s
        assert live((s + e) / 2) >= concurrency
    # Sample points outside all windows have fewer than C live (strictly inside gaps).
    points = sorted({x for span in spans for x in span})
    for p, q in itertools.pairwise(points):
        mid = (p + q) / 2
        inside = any(s < mid < e for s, e in windows)
        assert inside == (live(mid) >= concurrency)


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(1, 5), st.floats(0.01, 1)), min_size=1,
                max_size=8), st.integers(1, 4))  # fmt: skip
def test_full_live_tokens_never_exceed_total(specs, concurrency):
    records = [steady(i, s, s + 0.1, n + 1, step) for i, (s, n, step) in enumerate(specs)]
    tp = throughput(records, concurrency)
    assert 0 <= tp.full_live_tokens <= tp.num_output_tokens
    assert tp.full_live_s <= tp.duration_s + 1e-9
