"""Throughput arithmetic on stream timelines: full-live windows, refill rate, tokens/s over time.

A request is *decoding* from the arrival of its first token to the arrival of its last one (before
that it waits or prefills; after that it holds no slot). In a refill run with C slots, a
*full-live window* is a maximal interval in which C requests are decoding at once. Full-live
tokens/s counts the tokens that arrive inside those windows over their total length: it is the
steady-state decode rate at concurrency C, free of the ramp-up, the refill gaps (a finished
request's successor is still prefilling) and the drain at the end. A token arriving at the very
instant a window opens belongs to the request whose first token opened it (a prefill product),
so windows are half-open on the left: tokens count when they arrive in (start, end].

Finite refill tokens/s is simply all output tokens over the whole run, from the first submission
to the end of the last stream, drain included: what a user of a finite batch of work gets.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.records import RequestRecord


@dataclass(frozen=True)
class Throughput:
    num_output_tokens: int
    duration_s: float  # first submission to last stream end
    refill_tokens_per_s: float  # all tokens / duration
    full_live_s: float  # total length of the full-live windows
    full_live_tokens: int  # tokens that arrived inside them
    full_live_tokens_per_s: float | None  # None when C requests never decoded together
    num_windows: int


def decoding_intervals(records: Sequence[RequestRecord]) -> list[tuple[float, float]]:
    """[first token, last token] of each request that streamed at least one token."""
    return [(r.chunk_times_s[0], r.chunk_times_s[-1]) for r in records if r.chunk_times_s]


def full_live_windows(
    intervals: Sequence[tuple[float, float]], concurrency: int
) -> list[tuple[float, float]]:
    """Maximal intervals of positive length during which >= `concurrency` intervals overlap."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # Ends sort before starts at the same instant: a request that ends exactly when another
    # starts does not overlap it (a zero-length overlap carries no tokens anyway).
    spans = [(s, e) for s, e in intervals if e > s]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    windows: list[tuple[float, float]] = []
    live = 0
    opened: float | None = None
    for t, delta in events:
        live += delta
        if live >= concurrency and opened is None:
            opened = t
        elif live < concurrency and opened is not None:
            if t > opened:
                if windows and windows[-1][1] == opened:  # touching windows are one window
                    windows[-1] = (windows[-1][0], t)
                else:
                    windows.append((opened, t))
            opened = None
    return windows


def tokens_in_windows(
    records: Sequence[RequestRecord], windows: Sequence[tuple[float, float]]
) -> int:
    """Tokens whose chunk arrived in (start, end] of some window."""
    if not windows:
        return 0
    starts = [w[0] for w in windows]
    total = 0
    for r in records:
        for t, n in zip(r.chunk_times_s, r.chunk_tokens):
            i = bisect.bisect_left(starts, t) - 1  # last window starting strictly before t
            if i >= 0 and t <= windows[i][1]:
                total += n
    return total


def throughput(records: Sequence[RequestRecord], concurrency: int | None) -> Throughput:
    """Refill and (when `concurrency` is given) full-live throughput of one run."""
    num_tokens = sum(r.num_output_tokens for r in records if r.ok)
    if records:
        start = min(r.submit_s for r in records)
        end = max(r.end_s for r in records)
        duration = max(end - start, 0.0)
    else:
        duration = 0.0
    windows = full_live_windows(decoding_intervals(records), concurrency) if concurrency else []
    live_s = sum(e - s for s, e in windows)
    live_tokens = tokens_in_windows(records, windows)
    return Throughput(
        num_output_tokens=num_tokens,
        duration_s=duration,
        refill_tokens_per_s=num_tokens / duration if duration > 0 else 0.0,
        full_live_s=live_s,
        full_live_tokens=live_tokens,
        full_live_tokens_per_s=live_tokens / live_s if live_s > 0 else None,
        num_windows=len(windows),
    )


def tokens_per_s_over_time(
    records: Sequence[RequestRecord], num_bins: int = 60
) -> list[tuple[float, float]]:
    """(bin centre s, tokens/s) over the run, for the timeline plot."""
    times = [(t, n) for r in records for t, n in zip(r.chunk_times_s, r.chunk_tokens)]
    if not times or not records:
        return []
    start = min(r.submit_s for r in records)
    end = max(max(t for t, _ in times), max(r.end_s for r in records))
    span = end - start
    if span <= 0:
        return []
    width = span / num_bins
    counts = [0] * num_bins
    for t, n in times:
        counts[min(int((t - start) / width), num_bins - 1)] += n
    return [(start + (i + 0.5) * width, c / width) for i, c in enumerate(counts)]
