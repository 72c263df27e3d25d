"""Rounds planned and not yet updated, oldest first (two when one was advanced), and the
advanced AR round whose one token per request is counted before its result comes back."""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.plan import RoundPlan
from scheduler.slot_table import SlotTable


class InflightRound(msgspec.Struct, frozen=True):
    plan: RoundPlan
    # the cost model's raw prediction as planned (AR rounds: run ahead of the next round's
    # plan) and alone; they differ for AR rounds
    raw_ms: float
    raw_alone_ms: float
    expected_accepted: float  # accepted drafts the estimators expected of the round


class RoundsInFlight:
    def __init__(self, slot_table: SlotTable):
        self.slot_table = slot_table
        self._rounds: list[InflightRound] = []
        self.advanced: RoundPlan | None = None  # the launched AR round counted by advance()
        self._advanced_live = np.zeros(0, dtype=bool)  # [n] its rows that advance() counted

    @property
    def latest(self) -> InflightRound | None:
        return self._rounds[-1] if self._rounds else None

    def add(self, launched: InflightRound) -> None:
        self._rounds.append(launched)

    def take(self, round_id: int) -> InflightRound | None:
        """The round a result is for, if it is the oldest in flight (rounds planned with
        nothing to run, never launched, are dropped on the way)."""
        rounds = self._rounds
        while rounds and rounds[0].plan.round_id < round_id:
            rounds.pop(0)
        if rounds and rounds[0].plan.round_id == round_id:
            return rounds.pop(0)
        return None

    def advance(self, plan: RoundPlan) -> None:
        """Counts the launched AR-only decode round `plan` as done, one token per request."""
        if self.advanced is not None or not self._rounds or self._rounds[-1].plan is not plan:
            raise RuntimeError(f"round {plan.round_id} is not the last round launched")
        dec = plan.decode
        if plan.prefills or not len(dec) or dec.num_draft.any():
            raise ValueError(f"round {plan.round_id} is not an AR-only decode round")
        st = self.slot_table
        slots = dec.slots
        live = st.decoding[slots] & (st.req_id[slots] == dec.req_ids)
        step = live.astype(np.int64)
        st.num_computed[slots] += step
        st.remaining[slots] -= step
        st.drafter_lag[slots] += step
        self.advanced = plan
        self._advanced_live = live

    def take_back(self, plan: RoundPlan) -> None:
        """Before `plan`'s result is applied: if it is the advanced round, its count is taken
        back for the requests it counted and that still decode (the result applies the real
        one)."""
        if plan is not self.advanced:
            return
        self.advanced = None
        st = self.slot_table
        slots = plan.decode.slots
        step = (
            self._advanced_live & st.decoding[slots] & (st.req_id[slots] == plan.decode.req_ids)
        ).astype(np.int64)
        st.num_computed[slots] -= step
        st.remaining[slots] += step
        st.drafter_lag[slots] -= step

    def decoding_slots(self, live) -> np.ndarray:
        """The decoding slots that may get a row: while an advanced round runs (its tokens
        counted), not the requests it takes to max_tokens."""
        slots = self.slot_table.decoding_slots(live)
        if self.advanced is not None and len(slots):
            out_of_tokens = self.slot_table.remaining[slots] <= 0
            if out_of_tokens.any():
                return slots[~out_of_tokens]
        return slots
