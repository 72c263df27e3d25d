"""A round's measured period when rounds overlap: on the device's timeline where events exist,
so a neighbour's long launch on the host is not charged to it."""

from __future__ import annotations

import pytest

from executor.pending_round import PendingRound
from executor.round_timing import RoundPeriods


class _Event:
    """A recorded device event at `t` ms of the device's timeline."""

    def __init__(self, t: float):
        self.t = t
        self.waited = False

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end: _Event) -> float:
        return end.t - self.t


def _round(t0, start, end, behind=False, overlapped=False):
    p = PendingRound(plan=None, t0=t0, behind=behind, overlapped=overlapped)
    p.start_event, p.end_event = start, end
    return p


def _period(periods, p, t_end):
    ms = periods.period_ms(p, t_end)
    periods.finished(p, t_end)
    return ms


def test_overlapped_rounds_are_measured_on_the_device_timeline():
    # Device: AR round A runs 0-5 ms; round B (an eager prefill chunk) is launched behind it,
    # its launch holds the host until 30 ms, and it runs on the device 5-33 ms. The host
    # finishes A at 30.5 ms (after B's launch) and B at 33.5 ms.
    ex = RoundPeriods(last_end=0.0, last_end_event=_Event(0.0))
    a = _round(0.0, _Event(0.0), _Event(5.0), overlapped=True)
    b = _round(0.001, _Event(1.0), _Event(33.0), behind=True)
    assert _period(ex, a, 0.0305) == pytest.approx(5.0)  # not the 30.5 ms the host saw
    assert b.end_event.waited is False
    assert _period(ex, b, 0.0335) == pytest.approx(28.0)  # not the 3 ms since A's finish
    assert b.end_event.waited


def test_rounds_that_do_not_overlap_and_rounds_without_events_keep_the_host_period():
    ex = RoundPeriods(last_end=0.0, last_end_event=None)
    alone = _round(1.0, _Event(0.0), _Event(4.0))  # nothing launched behind it
    assert _period(ex, alone, 1.0062) == pytest.approx(6.2)  # its host work counts
    cpu = _round(2.0, None, None, overlapped=True)  # no device events (a CPU)
    assert _period(ex, cpu, 2.004) == pytest.approx(4.0)
    first = _round(3.0, _Event(10.0), _Event(15.0), behind=True)  # no earlier end event
    assert _period(ex, first, 3.009) == pytest.approx(9.0)
