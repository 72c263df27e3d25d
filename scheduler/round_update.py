"""Applying a round's result: the cost model's correction, the acceptance outcomes, counters,
stops inside accepted runs, outputs, and the KV past each committed end.

The decode rows are applied as whole columns; only requests whose run holds a stop candidate go
through a per-token loop. A stop inside an accepted run keeps the tokens up to it and the KV is
truncated there; results of requests aborted, stopped or preempted meanwhile are dropped.
"""

from __future__ import annotations

import numpy as np

from scheduler.acceptance import PROBE_CALIB_WEIGHT
from scheduler.cost_model import CostModel
from scheduler.kv_reservation import KVReservation
from scheduler.lifecycle import RequestLifecycle
from scheduler.pending_outcomes import AcceptanceOutcome, PendingOutcomes
from scheduler.plan import DecodeRows, Emitted, ReqPlan, RoundResult
from scheduler.policy import RateTracker, YieldTracker
from scheduler.request import ReqState, RoundDeltas
from scheduler.rounds_in_flight import RoundsInFlight
from scheduler.slot_table import SlotTable
from scheduler.stats import SchedulerCounters
from scheduler.stops import StopChecker, stop_in_run


class DeltaColumns:
    """Collects a round's deltas: the decode rows as whole columns, prefill rows one by one."""

    def __init__(self):
        self.parts: list[tuple] = []
        self.finish: dict[int, tuple[str, int | str | None]] = {}
        self.logprobs: dict = {}
        self.num_rows = 0

    def add_columns(self, req_ids, kept, token_ids, drafted, accepted, finish, logprobs):
        base = self.num_rows
        self.parts.append((req_ids, kept, token_ids, drafted, accepted))
        self.finish.update({base + i: f for i, f in finish.items()})
        self.logprobs.update({base + i: lp for i, lp in logprobs.items()})
        self.num_rows += len(req_ids)

    def add_row(self, req_id: int, token_ids: list[int], finish, logprobs) -> None:
        one = np.ones(1, dtype=np.int64)
        self.add_columns(
            one * req_id,
            one * len(token_ids),
            np.asarray(token_ids, dtype=np.int64),
            one * 0,
            one * 0,
            {0: finish} if finish is not None else {},
            {0: logprobs} if logprobs is not None else {},
        )

    def build(self) -> RoundDeltas:
        if not self.parts:
            return RoundDeltas.empty()
        columns = [np.concatenate(c) if len(self.parts) > 1 else c[0] for c in zip(*self.parts)]
        return RoundDeltas.build(*columns, self.finish, self.logprobs)


class ResultApplier:
    def __init__(
        self,
        slot_table: SlotTable,
        lifecycle: RequestLifecycle,
        reservation: KVReservation,
        in_flight: RoundsInFlight,
        outcomes: PendingOutcomes,
        cost_model: CostModel,
        rate_tracker: RateTracker,
        yield_tracker: YieldTracker,
        counters: SchedulerCounters,
        stop_checker: StopChecker | None,
    ):
        self.slot_table = slot_table
        self.lifecycle = lifecycle
        self.reservation = reservation
        self.in_flight = in_flight
        self.outcomes = outcomes
        self.cost_model = cost_model
        self.rate_tracker = rate_tracker
        self.yield_tracker = yield_tracker
        self.counters = counters
        self.stop_checker = stop_checker

    def apply(self, result: RoundResult, ar_rate: float) -> RoundDeltas:
        """`ar_rate`: tokens per ms of the latest plan's all-AR alternative (0: none)."""
        measured_ms = result.timings.total_ms
        self.counters.measured_ms = measured_ms
        launched = self.in_flight.take(result.round_id)
        plan = launched.plan if launched is not None else None
        # The round's period: a speculating round's also holds the engine's host time around
        # it, which the executor's measurement leaves out and its price includes.
        period_ms = measured_ms
        if measured_ms > 0:
            self.lifecycle.admission.charge(measured_ms / 1e3)
            if plan is not None and launched.raw_ms > 0:
                # an AR round that did not overlap the next one is compared with its price
                # alone: the correction stays about the model, not about the overlap
                raw = launched.raw_ms if result.overlapped else launched.raw_alone_ms
                if plan.spec_depth > 1:  # the engine's host time is not in the executor's
                    host_ms = self.cost_model.profile.round_spec_host_ms(
                        plan.num_rows,
                        sum(q.num_new for q in plan.prefills),
                        int(np.count_nonzero(plan.decode.num_draft)),
                        plan.spec_depth - 1,
                        int(plan.decode.num_draft.sum()),
                    )
                    raw -= host_ms
                    period_ms += host_ms
                self.cost_model.observe(
                    plan.num_rows, plan.spec_depth > 1, raw, measured_ms, bool(plan.prefills)
                )
        self.outcomes.add_round()  # this round decays every belief (applied later)
        out = result.out
        if plan is None:
            return RoundDeltas.empty()  # not the oldest round in flight: nothing to apply
        self.in_flight.take_back(plan)
        if len(out) != plan.num_reqs:
            raise ValueError(
                f"round {result.round_id}: {len(out)} result rows for {plan.num_reqs} requests"
            )
        dec = plan.decode
        n = len(dec)
        if n and not np.array_equal(out.req_ids[:n], dec.req_ids):
            raise ValueError(f"round {result.round_id}: result rows are not in plan order")
        starts = out.token_starts
        tokens = out.token_ids.tolist()
        cols = DeltaColumns()
        if n:
            self._apply_decode(dec, out, tokens, cols, plan.probe)
            d = dec.num_draft
            if d.any():
                accepted = float(np.minimum(out.num_accepted[:n], d).sum())
                self.yield_tracker.observe(launched.expected_accepted, accepted)
            else:
                self.yield_tracker.relax()
        for j, q in enumerate(plan.prefills):
            self._apply_prefill(
                q, out, n + j, tokens[starts[n + j] : starts[n + j + 1]], cols, plan.follow_prefill
            )
        if ar_rate > 0:
            # (in the currency of the plans it is compared with: priced periods)
            self.rate_tracker.observe(int(starts[-1]), period_ms, ar_rate)
        return cols.build()

    def _apply_decode(
        self, dec: DecodeRows, out: Emitted, tokens: list[int], cols: DeltaColumns, probe: bool
    ) -> None:
        """The decode rows: counters, stops, outputs and KV as array work."""
        st = self.slot_table
        n = len(dec)
        slots = dec.slots
        d = dec.num_draft
        starts = out.token_starts[: n + 1]
        emitted = np.diff(starts)  # [n]
        # aborted, finished by a stop string or preempted meanwhile: tokens are dropped
        live = st.decoding[slots] & (st.req_id[slots] == dec.req_ids)
        accepted = np.minimum(out.num_accepted[:n], d)
        spec = d > 0
        new_computed = st.num_computed[slots] + 1 + accepted
        st.num_computed[slots] = np.where(live, new_computed, st.num_computed[slots])
        lag = st.drafter_lag[slots]
        # a fully accepted chain leaves its last draft without draft KV: one row to catch up
        caught = (spec & (accepted == d)).astype(np.int64)
        st.drafter_lag[slots] = np.where(live, np.where(spec, caught, lag + 1), lag)
        observed = live & spec
        if observed.any():
            weight = PROBE_CALIB_WEIGHT if probe else 1.0
            self.outcomes.set_latest(
                AcceptanceOutcome(slots[observed], d[observed], accepted[observed], weight)
            )
            self.counters.num_drafted += int(d[observed].sum())
            self.counters.num_accepted += int(accepted[observed].sum())
        # Stops: max_tokens reached inside the run, a stop/EOS id among the tokens, or a stop
        # checker (then every request is checked).
        remaining = st.remaining[slots]
        candidate = live & (emitted >= remaining)
        stop_ids = self.lifecycle.stop_ids_arr
        if self.stop_checker is not None:
            candidate = live.copy()
        elif len(stop_ids) and starts[-1]:
            hits = np.flatnonzero(np.isin(out.token_ids[: starts[-1]], stop_ids))
            if len(hits):
                rows = np.searchsorted(starts, hits, side="right") - 1
                candidate[rows] |= live[rows]
        kept = np.where(live, emitted, 0)
        finish: dict[int, tuple[str, int | str | None]] = {}
        slot_reqs = st.reqs
        starts_l = starts.tolist()
        for i in np.flatnonzero(candidate).tolist():
            req = slot_reqs[slots[i]]
            stop = stop_in_run(req, tokens[starts_l[i] : starts_l[i + 1]], self.stop_checker)
            kept[i] = stop.num_kept
            if stop.finish_reason is not None:
                finish[i] = (stop.finish_reason, stop.stop_reason)
        kept_l = kept.tolist()
        for i in np.flatnonzero(live).tolist():
            a = starts_l[i]
            slot_reqs[slots[i]].output_token_ids += tokens[a : a + kept_l[i]]
        st.remaining[slots] -= kept
        for i, (reason, stop_reason) in finish.items():
            self.lifecycle.finish(slot_reqs[slots[i]], reason, stop_reason)
        # KV past the committed end (rejected drafts) goes back, unless the request finished
        # (AR rows hold exactly their committed blocks already, and a round planned ahead may
        # hold the block of its next position)
        bs = self.reservation.kv.block_size
        over = st.decoding[slots] & live & spec
        over &= st.num_blocks[slots] > -(-new_computed // bs)
        for i in np.flatnonzero(over).tolist():
            self.reservation.truncate(slot_reqs[slots[i]], int(new_computed[i]))
        # the deltas: live rows only, their tokens cut at the stop
        token_row = np.repeat(np.arange(n), emitted)
        within = np.arange(int(starts[-1])) - starts[token_row]
        rows = np.flatnonzero(live)
        index_of = np.cumsum(live) - 1  # row -> index among the live rows
        cols.add_columns(
            dec.req_ids[rows],
            kept[rows],
            out.token_ids[: starts[-1]][within < kept[token_row]],
            d[rows],
            accepted[rows],
            {int(index_of[i]): f for i, f in finish.items()},
            {
                int(index_of[i]): lps[: kept_l[i]]
                for i, lps in out.logprobs.items()
                if i < n and live[i]
            },
        )

    def _apply_prefill(
        self, q: ReqPlan, out: Emitted, row: int, tokens: list[int], cols: DeltaColumns, followed
    ) -> None:
        req = self.lifecycle.requests.get(q.req_id)
        if req is None or not req.is_live or req.slot != q.slot:
            return  # aborted or preempted meanwhile: its tokens are dropped
        # the drafter computed this chunk if it continued the draft KV it had; the first chunk
        # after a cached prefix it follows from the start (it has no draft KV of the prefix)
        start = 0 if q.num_computed == req.num_cached_tokens else q.num_computed
        if followed and req.drafter_followed == start:
            req.drafter_followed = q.num_computed + q.num_new
        req.num_computed += q.num_new
        self.lifecycle.prefix_cache.commit(req, req.num_computed)  # the chunk's full blocks
        if not q.sample:
            return
        req.state = ReqState.DECODING
        # the drafter has seen the context as far as it followed the prefill
        req.drafter_lag = req.num_prefill_target - req.drafter_followed
        self.lifecycle.cohort_changed = True
        stop = stop_in_run(req, tokens, self.stop_checker)
        keep = stop.num_kept
        req.output_token_ids += tokens[:keep]
        self.slot_table.start_decoding(req)
        if stop.finish_reason is not None:
            self.lifecycle.finish(req, stop.finish_reason, stop.stop_reason)
        else:
            self.reservation.truncate(req, req.num_computed)
        lps = out.logprobs.get(row)
        cols.add_row(
            req.req_id,
            tokens[:keep],
            (stop.finish_reason, stop.stop_reason) if stop.finish_reason is not None else None,
            lps[:keep] if lps is not None else None,
        )
