"""Building a round's `RoundPlan` from its decision: the drafts' KV, the decode columns, the
modes the requests switch to, the prefill chunks, the price and the graph bucket."""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.cost_model import CostModel
from scheduler.kv_reservation import ArRowBlocks, KVReservation
from scheduler.lifecycle import SlotChanges
from scheduler.plan import DecodeRows, Mode, RoundPlan
from scheduler.prefill_chunks import PrefillChunk, prefill_plans
from scheduler.round_decision import RoundDecision
from scheduler.slot_table import SlotTable
from scheduler.stats import SchedulerCounters

# a decode request's route letter from its speculating flag (a bool array's bytes)
_ROUTE_LETTERS = bytes.maketrans(b"\x00\x01", b"AS")


class DecodePart(msgspec.Struct, frozen=True):
    rows: DecodeRows
    route: str  # one letter per request: A or S
    num_rows: int
    num_kv_tokens: int
    max_num_draft: int  # the deepest chain's drafts
    drafter_lag: int  # rows the speculating requests' drafters have not seen


class RoundPrice(msgspec.Struct, frozen=True):
    raw_ms: float  # the cost model's prediction before its correction (AR: run ahead)
    raw_alone_ms: float  # the same for the round run alone
    predicted_ms: float  # corrected


class BuiltRound(msgspec.Struct, frozen=True):
    plan: RoundPlan
    price: RoundPrice


class RoundBuilder:
    def __init__(
        self,
        slot_table: SlotTable,
        reservation: KVReservation,
        cost_model: CostModel,
        counters: SchedulerCounters,
    ):
        self.slot_table = slot_table
        self.reservation = reservation
        self.cost_model = cost_model
        self.counters = counters

    def build(
        self,
        round_id: int,
        slots: np.ndarray,
        decision: RoundDecision,
        chunks: list[PrefillChunk],
        ar_blocks: ArRowBlocks | None,
        follow_prefill: bool,
        changes: SlotChanges,
    ) -> BuiltRound:
        """The plan of round `round_id`: `slots` decode (their AR rows' KV reserved, the AR
        blocks batched in `ar_blocks`) with `decision`'s drafts, next to `chunks`."""
        decode = self._decode(round_id, slots, decision.num_draft, ar_blocks)
        prefills = prefill_plans(chunks, self.reservation.kv)
        num_prefill_rows = sum(c.num_new for c in chunks)
        total_rows = decode.num_rows + num_prefill_rows
        kv_tokens = decode.num_kv_tokens + sum(q.num_computed + q.num_new for q in prefills)
        d_max = decode.max_num_draft
        num_draft = decode.rows.num_draft
        num_spec = int(np.count_nonzero(num_draft))
        cm = self.cost_model
        raw_ms = predicted_ms = 0.0
        if total_rows:
            raw_ms = cm.raw_ms_scalar(
                total_rows,
                kv_tokens,
                d_max,
                num_spec,
                decode.drafter_lag,
                num_prefill_rows,
                num_draft_rows=int(num_draft.sum()),
            )
            predicted_ms = cm.correct_ms_scalar(raw_ms, total_rows, d_max > 0, num_prefill_rows > 0)
        predicted_tokens = float(len(slots)) + float(sum(1 for c in chunks if c.completes))
        plan = RoundPlan(
            round_id=round_id,
            setup=tuple(changes.setups),
            release=tuple(changes.released),
            decode=decode.rows,
            prefills=prefills,
            follow_prefill=follow_prefill,
            num_rows=total_rows,
            row_bucket=self._row_bucket(total_rows, chunks),
            num_kv_tokens=kv_tokens,
            spec_depth=d_max + 1,
            drafter_lag_rows=decode.drafter_lag if d_max else 0,
            predicted_ms=predicted_ms,
            predicted_tokens=predicted_tokens + decision.expected_accepted,
            route=decode.route + "P" * len(prefills),
            reason=decision.reason,
            probe=decision.probe,
        )
        raw_alone_ms = raw_ms
        if total_rows and d_max == 0 and not num_prefill_rows:
            raw_alone_ms /= cm.profile.ahead_ratio_scalar(total_rows)
        return BuiltRound(plan, RoundPrice(raw_ms, raw_alone_ms, predicted_ms))

    def _decode(
        self,
        round_id: int,
        slots: np.ndarray,
        num_draft: np.ndarray,
        ar_blocks: ArRowBlocks | None,
    ) -> DecodePart:
        """Allocates the drafts' KV blocks and builds the decode columns."""
        n = len(slots)
        if n == 0:
            return DecodePart(DecodeRows.empty(), "", 0, 0, 0, 0)
        st = self.slot_table
        bs = self.reservation.kv.block_size
        num_computed = st.num_computed[slots]  # [n]
        drafts = self.reservation.reserve_drafts(slots, num_draft)
        d = drafts.num_draft
        if not drafts.batched:
            ar_blocks = None
        spec = d > 0
        self._record_modes(round_id, slots, spec)
        # The table is exactly ceil(num_computed / bs) long after update(); every block past
        # that was allocated for this round (AR row, drafts).
        block_offset = (num_computed + (bs - 1)) // bs  # ceil(num_computed / bs)
        block_counts = np.maximum(st.num_blocks[slots] - block_offset, 0)
        req_ids = st.req_id[slots]
        new_ids = self.reservation.new_block_ids(
            req_ids, block_offset, block_counts, ar_blocks, drafts.blocks
        )
        rows = DecodeRows.build(
            req_ids, slots, num_computed, d, block_offset, block_counts, new_ids
        )
        total_rows = n + int(d.sum())
        return DecodePart(
            rows=rows,
            route=spec.tobytes().translate(_ROUTE_LETTERS).decode(),
            num_rows=total_rows,
            num_kv_tokens=int(num_computed.sum()) + total_rows,
            max_num_draft=int(d.max()),
            drafter_lag=int(st.drafter_lag[slots] @ spec),
        )

    def _record_modes(self, round_id: int, slots: np.ndarray, spec: np.ndarray) -> None:
        """The requests' modes of this round, and since when they hold them."""
        st = self.slot_table
        mode = spec + int(Mode.AR)  # [n] AR or SPEC (Mode.SPEC == Mode.AR + 1)
        last_mode = st.last_mode[slots]
        changed = mode != last_mode
        if changed.any():
            # the first decision after the prefill is not a switch
            self.counters.num_switches += int(
                np.count_nonzero(changed & (last_mode != Mode.PREFILL))
            )
            moved = slots[changed]
            st.last_mode[moved] = mode[changed]
            st.mode_since[moved] = round_id

    def _row_bucket(self, num_rows: int, chunks: list[PrefillChunk]) -> int:
        """Graph bucket of a decode-only round; prefill rounds and rows past the largest bucket
        run eagerly (0)."""
        profile = self.cost_model.profile
        buckets = profile.row_buckets
        if chunks or num_rows == 0 or num_rows > buckets[-1]:
            return 0
        return int(buckets[profile.bucket_index_list[num_rows]])  # (a scalar table lookup)
