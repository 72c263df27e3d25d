"""Chunked prefill: which prompt rows a round computes, within the prefill budget.

Prompts are chunked oldest admission first. A prompt's rest of at most 1/PREFILL_TAIL_DIV of the
budget goes with its chunk rather than into a round of its own: every round with a chunk runs
eagerly, bound by launching its kernels, where its decoding requests could otherwise run a
graphed decode round. A round then holds up to `max_chunk_rows(budget)` prompt rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from scheduler.kv_blocks import BlockPool, num_blocks_for
from scheduler.plan import Mode, ReqPlan
from scheduler.request import Request

if TYPE_CHECKING:
    from scheduler.kv_reservation import KVReservation
    from scheduler.lifecycle import SlotChanges

PREFILL_TAIL_DIV = 8


def prefill_tail_rows(max_prefill_tokens: int) -> int:
    """A prompt's rest taken with its chunk past a prefill budget, at most."""
    return max_prefill_tokens // PREFILL_TAIL_DIV


def max_chunk_rows(max_prefill_tokens: int) -> int:
    """The most prompt rows one round takes under a prefill budget (its short-rest allowance)."""
    return max_prefill_tokens + prefill_tail_rows(max_prefill_tokens)


class PrefillChunk(msgspec.Struct, frozen=True):
    """`num_new` context rows of a prefilling request, from its `num_computed` on."""

    req: Request
    num_new: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the end of the context: its last row samples the first token."""
        req = self.req
        return req.num_computed + self.num_new == req.num_prefill_target


def choose_chunks(
    prefilling: list[Request],
    max_prefill_tokens: int,
    reservation: KVReservation,
    changes: SlotChanges,
) -> list[PrefillChunk]:
    """The round's chunks, oldest admission first, each with its KV reserved (which may preempt
    younger requests); stops at the budget or at the first chunk whose KV does not fit."""
    budget = max_prefill_tokens
    tail = prefill_tail_rows(max_prefill_tokens)
    chunks: list[PrefillChunk] = []
    for req in prefilling:
        if budget <= 0:
            break
        if req.slot < 0:
            continue  # preempted to make room for an older request
        rest = req.num_prefill_target - req.num_computed
        chunk = min(rest, budget)
        if rest - chunk <= tail:  # a short rest goes with it
            chunk = rest
        if not reservation.reserve(req, req.num_computed + chunk, changes):
            break
        chunks.append(PrefillChunk(req, chunk))
        budget -= chunk
    return chunks


def prefill_plans(chunks: list[PrefillChunk], kv: BlockPool) -> tuple[ReqPlan, ...]:
    """The chunks as the plan carries them, with the KV blocks reserved for them."""
    bs = kv.block_size
    plans = []
    for c in chunks:
        req = c.req
        first_new = num_blocks_for(req.num_computed, bs)
        plans.append(
            ReqPlan(
                req_id=req.req_id,
                slot=req.slot,
                mode=Mode.PREFILL,
                num_computed=req.num_computed,
                num_new=c.num_new,
                block_offset=first_new,
                new_block_ids=kv.blocks_from(req.req_id, first_new),
                sample=req.num_computed + c.num_new == req.num_prefill_target,
            )
        )
    return tuple(plans)
