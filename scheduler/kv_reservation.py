"""KV reservation for the rows of a round, and preemption when the pool runs short.

Before a round, blocks are allocated for every position it writes (prefill chunk; AR row; SPEC
row + drafts); after it, blocks past the committed length go back. When a prefill chunk or even
the AR rows do not fit, the most recently admitted other requests are preempted (their context
is recomputed later by prefill chunks); the longest-running ones are protected. A victim's
private blocks are what make room: the blocks it shares with others only lose a reference. Drafts
that do not fit are dropped.
"""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.kv_blocks import BlockPool, num_blocks_for
from scheduler.lifecycle import RequestLifecycle, SlotChanges
from scheduler.request import Request
from scheduler.slot_table import SlotTable


class ArRowBlocks(msgspec.Struct, frozen=True):
    """The AR rows' new blocks from one batched allocation: one block for each listed row."""

    rows: np.ndarray  # [m] indices into the round's decoding slots
    block_ids: list[int]  # [m]


class ArRowReservation(msgspec.Struct, frozen=True):
    slots: np.ndarray  # [n] the decoding slots whose AR row has its KV
    # None: allocated request by request (the new ids are then read from the pool's tables)
    blocks: ArRowBlocks | None


class DraftBlocks(msgspec.Struct, frozen=True):
    """The drafts' new blocks from one batched allocation."""

    rows: np.ndarray  # [m] indices into the round's decoding slots
    counts: np.ndarray  # [m] new blocks of each
    block_ids: list[int]  # [counts.sum()]


class DraftReservation(msgspec.Struct, frozen=True):
    num_draft: np.ndarray  # [n] the drafts whose KV is allocated (some dropped if it was short)
    blocks: DraftBlocks | None  # None: none allocated in one batch
    # False: allocated request by request (the AR rows' batched ids no longer account for
    # every new block)
    batched: bool


class KVReservation:
    def __init__(
        self,
        kv: BlockPool,
        slot_table: SlotTable,
        lifecycle: RequestLifecycle,
        draft_lookahead: int = 0,
    ):
        self.kv = kv
        self.slot_table = slot_table
        self.lifecycle = lifecycle
        # positions past the AR row a speculating request writes at least (its drafter's)
        self.draft_lookahead = draft_lookahead

    def reserve(self, req: Request, num_tokens: int, changes: SlotChanges) -> bool:
        """Allocates blocks covering `num_tokens` positions of `req`, preempting the most
        recently admitted other requests when the pool is short. Older requests are protected:
        returns False (nothing allocated) when only they could make room."""
        kv = self.kv
        need = num_blocks_for(num_tokens, kv.block_size) - kv.num_blocks_of(req.req_id)
        while need > kv.num_free:
            victim = max(
                (r for r in self.lifecycle.live if r is not req),
                key=lambda r: r.admit_seq,
                default=None,
            )
            if victim is None or victim.admit_seq < req.admit_seq:
                return False
            self.lifecycle.preempt(victim, changes)
        if need > 0:
            kv.allocate(req.req_id, need)
            self.slot_table.num_blocks[req.slot] += need
        return True

    def reserve_ar_rows(self, slots: np.ndarray, changes: SlotChanges) -> ArRowReservation:
        """KV for every decoding request's AR row, oldest first (which may preempt younger
        requests); the requests whose row does not fit get none this round."""
        st = self.slot_table
        blocks: ArRowBlocks | None = ArRowBlocks(np.zeros(0, np.int64), [])
        if not len(slots):
            return ArRowReservation(slots, blocks)
        # the block of the AR row's position is usually held already
        lacking = np.flatnonzero(
            st.num_computed[slots] >= st.num_blocks[slots] * self.kv.block_size
        )
        if len(lacking) and len(lacking) <= self.kv.num_free:
            ids = self.kv.allocate_one_each(st.req_id[slots[lacking]].tolist())
            st.num_blocks[slots[lacking]] += 1
            blocks = ArRowBlocks(lacking, ids)
        elif len(lacking):
            blocks = None
            keep = np.ones(len(slots), dtype=bool)
            for i in lacking.tolist():  # oldest first; may preempt younger requests
                req = st.reqs[slots[i]]
                gone = req is None or req.slot < 0 or not st.decoding[req.slot]
                end = 0 if gone else int(st.num_computed[req.slot]) + 1
                if gone or not self.reserve(req, end, changes):
                    keep[i] = False
            slots = slots[keep]
        return ArRowReservation(slots, blocks)

    def reserve_drafts(self, slots: np.ndarray, num_draft: np.ndarray) -> DraftReservation:
        """KV for the drafts of the speculating requests (their AR row's is held already): a
        request with d drafts writes positions up to num_computed + max(d, lookahead)."""
        kv = self.kv
        st = self.slot_table
        bs = kv.block_size
        d = num_draft
        if int(d.max(initial=0)) <= 0:
            return DraftReservation(d, None, True)
        num_computed = st.num_computed[slots]  # [n]
        reach = np.where(d > 0, np.maximum(d, self.draft_lookahead), 0)  # [n] positions past
        reach_max = int(reach.max())
        # Every request needs at most ceil(reach / bs) + 1 new blocks; when the pool holds
        # that for everyone, no request can run short (the common case: one batched allocation).
        if len(slots) * (-(-reach_max // bs) + 1) <= kv.num_free:
            # blocks to cover rows up to position num_computed + reach: ceil((nc + r + 1) / bs)
            need = (num_computed + reach) // bs + 1 - st.num_blocks[slots]
            take = np.flatnonzero((need > 0) & (d > 0))
            if not len(take):
                return DraftReservation(d, None, True)
            need = need[take]  # [len(take)]
            ids = self._allocate_many(slots[take], need)
            return DraftReservation(d, DraftBlocks(take, need, ids), True)
        d = d.copy()
        for i in np.flatnonzero(d).tolist():
            slot = int(slots[i])
            held = int(st.num_blocks[slot])
            start = int(num_computed[i]) + 1
            di = int(d[i])
            need = self._draft_need(start, di, held)
            # drafts whose KV does not fit are dropped, never an error
            while di > 0 and need > kv.num_free:
                di -= 1
                need = self._draft_need(start, di, held)
            if need > 0 and di > 0:
                self._allocate_many(slots[i : i + 1], np.array([need], dtype=np.int64))
            d[i] = di
        return DraftReservation(d, None, False)

    def new_block_ids(
        self,
        req_ids: np.ndarray,
        block_offset: np.ndarray,
        block_counts: np.ndarray,
        ar_blocks: ArRowBlocks | None,
        draft_blocks: DraftBlocks | None,
    ):
        """Flat new block ids of the decode rows in request order: from this round's batched
        allocations (AR row block first, then the drafts') when they account for every new
        block, else gathered from the pool's tables."""
        if ar_blocks is not None:
            ar_idx, ar_ids = ar_blocks.rows, ar_blocks.block_ids
            num_drafts = len(draft_blocks.block_ids) if draft_blocks is not None else 0
            # Every request already held the blocks of its committed tokens, so it has at least
            # as many new blocks as this round allocated for it: equal totals, equal counts.
            if len(ar_ids) + num_drafts == int(block_counts.sum()):
                if not num_drafts:
                    return ar_ids  # already in request order
                take, need, draft_ids = (
                    draft_blocks.rows,
                    draft_blocks.counts,
                    draft_blocks.block_ids,
                )
                # request i's AR block (key 2i) goes before its drafts' blocks (key 2i + 1)
                draft_keys = take * 2 + 1  # [len(take)]
                if num_drafts != len(take):
                    draft_keys = np.repeat(draft_keys, need)  # [num_drafts]
                order = np.argsort(np.concatenate((ar_idx * 2, draft_keys)), kind="stable")
                return np.array(ar_ids + draft_ids, dtype=np.int64)[order]
        new_ids: list[int] = []
        tables = self.kv.tables
        for i in np.flatnonzero(block_counts).tolist():
            new_ids += tables[int(req_ids[i])][int(block_offset[i]) :]
        return new_ids

    def _draft_need(self, start: int, num_draft: int, held: int) -> int:
        """New blocks a request holding `held` needs for `num_draft` drafts after its AR row's
        `start` positions (none without drafts)."""
        reach = max(num_draft, self.draft_lookahead) if num_draft else 0
        return -(-(start + reach) // self.kv.block_size) - held

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past `num_tokens` positions."""
        self.kv.truncate_to(req.req_id, num_tokens)
        self.slot_table.num_blocks[req.slot] = self.kv.num_blocks_of(req.req_id)

    def _allocate_many(self, slots: np.ndarray, counts: np.ndarray) -> list[int]:
        new_ids = self.kv.allocate_many(self.slot_table.req_id[slots].tolist(), counts.tolist())
        self.slot_table.num_blocks[slots] += counts
        return new_ids
