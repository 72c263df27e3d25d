"""What the engine reports of itself: a record per finished round (`RoundStats`, kept by
`RoundRecorder` until drained) and a snapshot of the engine (`EngineStats`)."""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.plan import RoundPlan, RoundResult

# records kept when nobody drains them: past MAX_ROUNDS the oldest DROP_ROUNDS go
MAX_ROUNDS = 4096
DROP_ROUNDS = 2048


class RoundStats(msgspec.Struct, kw_only=True):
    route: str
    num_rows: int
    num_padded_rows: int
    num_kv_tokens: int  # KV tokens the round's attention read (new rows included)
    num_spec: int
    num_ar: int
    num_prefill: int
    predicted_s: float
    measured_s: float
    phase_s: dict[str, float]
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]
    policy_switches: int
    reason: str
    overlapped: bool = False  # the next round was launched before this one finished
    # tokens the plan expected (one per decoding request, the drafts the estimators expect
    # accepted, prefills that complete)
    predicted_tokens: float = 0.0
    num_emitted: int = 0  # output tokens the round emitted (after stops)


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    slot_capacity: int
    live_slots: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    rounds: list[RoundStats] = msgspec.field(default_factory=list)


class RoundRecorder:
    """The records of finished rounds, in the order they finished, until `drain()`."""

    def __init__(self):
        self._rounds: list[RoundStats] = []
        # the scheduler's switch count at the last record: each record has the switches since
        self.switches_seen = 0

    def record(
        self,
        plan: RoundPlan,
        result: RoundResult,
        *,
        num_policy_switches: int,
        plan_s: float,
        collect_s: float,
        update_s: float,
    ) -> None:
        """`num_policy_switches`: the scheduler's total now; the host times of the round's
        scheduler.plan, of the earlier outputs collected while it ran, and of its update."""
        out = result.out
        depth = int(plan.decode.num_draft.max(initial=0))
        positions = np.arange(depth)[:, None]  # [depth, 1]
        drafted = (out.num_drafted[None, :] > positions).sum(1).tolist()
        accepted = (np.minimum(out.num_accepted, out.num_drafted)[None, :] > positions).sum(1)
        t = result.timings
        new_switches = num_policy_switches - self.switches_seen
        self.switches_seen = num_policy_switches
        route = plan.route
        self._rounds.append(
            RoundStats(
                route=route,
                num_rows=result.num_rows,
                num_padded_rows=result.num_padded_rows,
                num_kv_tokens=result.num_kv_tokens,
                num_spec=route.count("S"),
                num_ar=route.count("A"),
                num_prefill=route.count("P"),
                predicted_s=plan.predicted_ms / 1e3,
                measured_s=t.total_ms / 1e3,
                phase_s={
                    "build": t.build_ms / 1e3,
                    "draft": t.draft_ms / 1e3,
                    "draft_wait": t.draft_wait_ms / 1e3,  # of it, waiting for the device
                    "catchup": t.catchup_ms / 1e3,  # of it, the drafter's catch-up (device)
                    "forward": t.forward_ms / 1e3,
                    "accept": t.accept_ms / 1e3,
                    "commit": t.commit_ms / 1e3,
                    "plan": plan_s,  # scheduler.plan on the host
                    # the previous round's outputs (detokenization, stop strings), overlapped
                    # with this round's device work
                    "collect": collect_s,
                    "update": update_s,  # scheduler.update on the host
                },
                drafted_per_pos=drafted,
                accepted_per_pos=accepted.tolist(),
                policy_switches=new_switches,
                reason=plan.reason,
                overlapped=result.overlapped,
                predicted_tokens=plan.predicted_tokens,
                num_emitted=int(out.token_starts[-1]),
            )
        )
        if len(self._rounds) > MAX_ROUNDS:  # nobody drained the stats: keep memory bounded
            del self._rounds[:DROP_ROUNDS]

    def drain(self) -> list[RoundStats]:
        """The records since the last drain, oldest first; the recorder keeps none of them."""
        rounds, self._rounds = self._rounds, []
        return rounds

    def clear(self) -> None:
        """Forgets every record, and counts switches from zero (a fresh scheduler's count)."""
        self._rounds.clear()
        self.switches_seen = 0
