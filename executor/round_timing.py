"""A finished round's phase times and its share of the wall time (`PhaseTimes`)."""

from __future__ import annotations

from dataclasses import dataclass

from executor.pending_round import PendingRound
from scheduler.plan import PhaseTimes


def phase_times(
    p: PendingRound, t_wait: float, t_commit: float, t_end: float, total_ms: float
) -> PhaseTimes:
    """`p`'s phases from its launch marks and the host clock of its finish: the wait for the
    device began at `t_wait`, the commit at `t_commit`, the finish ended at `t_end`."""
    t, drafts, ms = p.times, p.drafts, 1e3
    return PhaseTimes(
        build_ms=(t.forward - t.build + t.draft - p.t0) * ms,
        draft_ms=(t.build - t.draft) * ms,
        catchup_ms=drafts.catchup_ms if drafts is not None else 0.0,
        draft_wait_ms=drafts.extra.get("wait_ms", 0.0) if drafts is not None else 0.0,
        # device time of the forward where events exist (host time otherwise)
        forward_ms=(
            p.fwd_events[0].elapsed_time(p.fwd_events[1])
            if p.fwd_events is not None
            else (t.accept - t.forward) * ms
        ),
        # launching the acceptance, then waiting for its copy (the device's remaining work)
        accept_ms=(t.launched - t.accept + t_commit - t_wait) * ms,
        commit_ms=(t_end - t_commit) * ms,
        total_ms=total_ms,
    )


@dataclass
class RoundPeriods:
    """Each finished round's share of the wall time, rounds finishing in launch order."""

    last_end: float = 0.0  # host clock when the last round finished
    last_end_event: object = None  # that round's end event (GPU)

    def period_ms(self, p: PendingRound, t_end: float) -> float:
        """On the host: from the round's launch, or from the previous finish for a round
        launched before it. Where rounds overlap on a GPU, on the device's timeline instead:
        from the previous round's end (a round launched behind it) or from its own launch (a
        round another was launched behind) to its own end. On the host either would also count
        the host time its neighbour's launch took: an eager prefill chunk launched behind an
        AR round holds the host for a long time, which would be charged to the AR round (and
        price AR rounds too high), while the chunk's round, its device work done by then, would
        measure almost nothing."""
        host_ms = (t_end - max(p.t0, self.last_end)) * 1e3
        if p.end_event is None or not (p.behind or p.overlapped):
            return host_ms
        start = self.last_end_event if p.behind else p.start_event
        if start is None:
            return host_ms
        p.end_event.synchronize()  # (the acceptance copy was waited for: done or nearly)
        return float(start.elapsed_time(p.end_event))

    def finished(self, p: PendingRound, t_end: float) -> None:
        self.last_end = t_end
        self.last_end_event = p.end_event
