"""Per-slot state of decoding requests as numpy columns, indexed by slot.

While a request decodes, these arrays are the source of truth for what the policy and the plan
need (committed length, drafter lag, mode and since when, tokens left, KV blocks held), so a
round's decode columns are built and its result applied with array operations. `Request`
objects carry the rest (lifecycle, outputs) and the state of prefilling requests.
"""

from __future__ import annotations

import numpy as np

from scheduler.request import ReqState, Request

SPECULATION_CODE = {"off": 0, "auto": 1, "on": 2}  # a request's `speculation` as a column value


class SlotTable:
    def __init__(self, num_slots: int):
        self.reqs: list[Request | None] = [None] * num_slots
        self.req_id = np.full(num_slots, -1, dtype=np.int64)
        self.decoding = np.zeros(num_slots, dtype=bool)
        self.num_computed = np.zeros(num_slots, dtype=np.int64)
        self.drafter_lag = np.zeros(num_slots, dtype=np.int64)
        self.last_mode = np.zeros(num_slots, dtype=np.int64)
        self.mode_since = np.zeros(num_slots, dtype=np.int64)
        self.remaining = np.zeros(num_slots, dtype=np.int64)  # max_tokens - outputs
        self.spec_code = np.zeros(num_slots, dtype=np.int64)  # SPECULATION_CODE
        self.grammar = np.zeros(num_slots, dtype=bool)  # output constrained by a grammar
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)  # KV blocks the request holds
        self._order = np.zeros(0, dtype=np.int64)  # decoding slots in admission order
        self._order_stale = False

    def assign(self, req: Request) -> None:
        """The request takes its slot (admission)."""
        self.reqs[req.slot] = req
        self.req_id[req.slot] = req.req_id

    def clear(self, slot: int) -> None:
        """The slot's request left it (its blocks are already back in the pool)."""
        self.reqs[slot] = None
        self.req_id[slot] = -1
        self.num_blocks[slot] = 0

    def start_decoding(self, req: Request) -> None:
        """Prefill done: the request's decode state moves into the columns."""
        slot = req.slot
        self.num_computed[slot] = req.num_computed
        self.drafter_lag[slot] = req.drafter_lag
        self.last_mode[slot] = req.last_mode
        self.mode_since[slot] = req.mode_since_round
        self.remaining[slot] = req.num_remaining
        self.spec_code[slot] = SPECULATION_CODE[req.spec.speculation]
        self.grammar[slot] = req.spec.sampling.grammar is not None
        self.decoding[slot] = True
        self._order_stale = True

    def end_decoding(self, req: Request) -> None:
        """The request no longer decodes: later plans skip it, results in flight are dropped."""
        if req.slot >= 0 and self.decoding[req.slot]:
            self.decoding[req.slot] = False
            self._order_stale = True

    def decoding_slots(self, live: list[Request]) -> np.ndarray:
        """[n] slots of the decoding requests among `live` in admission order, rebuilt (a new
        array, never changed in place) only after the decoding set changed: the same object
        means the same requests."""
        if self._order_stale:
            self._order = np.array(
                [r.slot for r in live if r.state == ReqState.DECODING and r.slot >= 0],
                dtype=np.int64,
            )
            self._order_stale = False
        return self._order

    def may_hold_prefilling(self, num_live: int) -> bool:
        """Whether some of `num_live` live requests may not be decoding (more live requests
        than decoding slots, or the decoding set changed since it was last listed)."""
        return num_live > len(self._order) or self._order_stale
