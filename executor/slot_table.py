"""The round executor's host state per slot: the request that holds the slot, its committed
context and KV length, its sampling parameters in the packed layout of `executor.sampling`, and
its block table (the rows a round touches are uploaded with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from executor.sampling import FLOAT_PARAMS, has_penalties, sampling_row
from scheduler.plan import RoundPlan, SeqSetup, offsets

if TYPE_CHECKING:
    from executor.accept import RoundTokens


@dataclass(frozen=True)
class RoundRequests:
    """The planned requests of a round in row order: the decode requests, then prefill chunks."""

    num_decode: int  # n
    slots: np.ndarray  # [m] int64
    req_ids: np.ndarray  # [m] int64
    num_computed: np.ndarray  # [m] int64 committed KV length when the round starts

    @classmethod
    def of_plan(cls, plan: RoundPlan) -> RoundRequests:
        dec, prefills = plan.decode, plan.prefills

        def column(decode: np.ndarray, values: list[int]) -> np.ndarray:
            return np.concatenate([decode, values]).astype(np.int64)

        return cls(
            num_decode=len(dec),
            slots=column(dec.slots, [q.slot for q in prefills]),
            req_ids=column(dec.req_ids, [q.req_id for q in prefills]),
            num_computed=column(dec.num_computed, [q.num_computed for q in prefills]),
        )


class SlotTable:
    def __init__(
        self,
        *,
        max_slots: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        vocab_size: int,
        base_seed: int,
    ):
        self.vocab_size = vocab_size
        self.base_seed = base_seed
        self.slot_req = np.full(max_slots, -1, dtype=np.int64)  # req_id, -1: free
        self.num_computed = np.zeros(max_slots, dtype=np.int64)  # committed KV length
        self.num_cached = np.zeros(max_slots, dtype=np.int64)  # of it, a cached prefix at setup
        self.context_len = np.zeros(max_slots, dtype=np.int64)  # prompt + committed outputs
        self.tokens = np.zeros((max_slots, max_model_len + 1), dtype=np.int32)  # contexts
        self.float_params = np.zeros((len(FLOAT_PARAMS), max_slots), dtype=np.float32)
        self.top_k = np.zeros(max_slots, dtype=np.int64)  # vocab size when off
        self.seed = np.zeros(max_slots, dtype=np.int64)
        self.greedy = np.ones(max_slots, dtype=bool)
        self.penalised = np.zeros(max_slots, dtype=bool)
        # sampled with a seed of its own: its drafts share the target's noise (DraftRequest.seed)
        self.coupled = np.zeros(max_slots, dtype=bool)
        self.logprobs_k = np.full(max_slots, -1, dtype=np.int64)  # -1: no logprobs
        # A model drafter keeps its KV under the same block ids and reads this table too.
        self.block_tables = np.zeros((max_slots, max_blocks_per_seq), dtype=np.int32)

    def setup(self, s: SeqSetup, context: list[int]) -> None:
        """A request enters `s.slot` with its context (`s.context_token_ids` as a list);
        nothing of it is computed yet but a cached prefix, whose blocks start its table."""
        slot = s.slot
        if len(context) > self.tokens.shape[1]:
            raise ValueError(f"slot {slot}: context of {len(context)} tokens exceeds the limit")
        num_cached = s.num_cached_tokens
        if not 0 <= num_cached < len(context) or (num_cached > 0) != bool(s.cached_block_ids):
            raise ValueError(
                f"slot {slot}: {num_cached} cached tokens in {len(s.cached_block_ids)} blocks "
                f"for a context of {len(context)}"
            )
        if s.cached_block_ids:
            self.block_tables[slot, : len(s.cached_block_ids)] = s.cached_block_ids
        self.slot_req[slot] = s.req_id
        self.num_computed[slot] = self.num_cached[slot] = num_cached
        self.context_len[slot] = len(context)
        self.tokens[slot, : len(context)] = context
        spec = s.sampling
        row = sampling_row(spec, s.req_id, self.base_seed, self.vocab_size)
        self.float_params[:, slot] = row.floats
        self.top_k[slot], self.seed[slot] = row.top_k, row.seed
        self.greedy[slot] = spec.greedy
        self.penalised[slot] = has_penalties(spec)
        self.coupled[slot] = spec.seed is not None and not spec.greedy
        self.logprobs_k[slot] = -1 if spec.logprobs is None else spec.logprobs

    def release(self, slot: int) -> None:
        self.slot_req[slot] = -1

    def context(self, slot: int) -> np.ndarray:
        """The slot's committed context (prompt + outputs), a view."""
        return self.tokens[slot, : self.context_len[slot]]

    def rewind(self, slot: int, context_len: int, num_computed: int | None = None) -> None:
        self.context_len[slot] = context_len
        self.num_computed[slot] = context_len - 1 if num_computed is None else num_computed

    def check_round(self, requests: RoundRequests) -> None:
        """Raises unless every planned request holds its slot at the planned KV length."""
        slots, computed = requests.slots, requests.num_computed
        bad = np.flatnonzero(
            (self.slot_req[slots] != requests.req_ids) | (self.num_computed[slots] != computed)
        )
        if len(bad):
            i = int(bad[0])
            s = int(slots[i])
            raise RuntimeError(
                f"plan/executor state mismatch for req {requests.req_ids[i]} in slot {s}: "
                f"executor has req {self.slot_req[s]} at {self.num_computed[s]} tokens, plan "
                f"says {computed[i]}"
            )

    def add_blocks(self, plan: RoundPlan) -> None:
        """The round's new KV block ids into their slots' table rows."""
        dec = plan.decode
        if len(dec.new_block_ids):
            owner = np.repeat(np.arange(len(dec)), np.diff(dec.block_starts))
            col = (
                dec.block_offset[owner]
                + np.arange(len(dec.new_block_ids))
                - dec.block_starts[owner]
            )
            self.block_tables[dec.slots[owner], col] = dec.new_block_ids
        for q in plan.prefills:
            if q.new_block_ids:
                self.block_tables[
                    q.slot, q.block_offset : q.block_offset + len(q.new_block_ids)
                ] = q.new_block_ids

    def commit(
        self, requests: RoundRequests, emitted: RoundTokens, num_grown: np.ndarray | None
    ) -> np.ndarray:
        """Commits a finished round for the slots its requests still hold (a slot released
        since the launch of an advanced round has moved on): KV lengths grow by `num_grown`
        [m] (None: `advance` counted them), contexts by the emitted tokens. Returns [m] bool:
        the request still holds its slot."""
        slots = requests.slots
        own = self.slot_req[slots] == requests.req_ids  # [m]
        if num_grown is not None:
            self.num_computed[slots] += np.where(own, num_grown, 0)
        num_emitted, tokens = emitted.num_emitted, emitted.tokens
        starts = offsets(num_emitted)
        tok_owner = np.repeat(np.arange(len(slots)), num_emitted)
        tok_slot = slots[tok_owner]
        tok_pos = self.context_len[tok_slot] + np.arange(len(tokens)) - starts[tok_owner]
        tok_own = own[tok_owner]
        if tok_own.any() and int(tok_pos[tok_own].max()) >= self.tokens.shape[1]:
            raise RuntimeError("a slot's context grew past the executor's max_model_len")
        self.tokens[tok_slot[tok_own], tok_pos[tok_own]] = tokens[tok_own]
        self.context_len[slots] += np.where(own, num_emitted, 0)
        return own
