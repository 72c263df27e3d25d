"""One round's rows: the ragged batch on the host, in plan order (each decode request's rows, the
AR row or the SPEC group of last committed token + drafts, then the PREFILL chunks), built with
numpy from the plan's columns and the slot table; and its upload, every array packed into one
host buffer and sent with ONE non-blocking copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.drafters.base import DraftBatch
from executor.host_buffer import HostBuffer
from executor.model import AttnMetadata
from executor.sampling import PackedSampling, SamplingTensors
from executor.slot_table import RoundRequests, SlotTable
from scheduler.plan import RoundPlan, offsets


@dataclass(frozen=True)
class RaggedBatch:
    """A round's rows on the host. R rows in all; L of them have logits (every decode row, and
    the last row of each prefill chunk that samples)."""

    requests: RoundRequests
    group_rows: np.ndarray  # [m + 1] first row of each request's rows, then R
    row_in_group: np.ndarray  # [R] index of the row among its request's rows
    input_ids: np.ndarray  # [R] int64; 0 at draft rows while `drafts_pending`
    positions: np.ndarray  # [R] int64
    slot_mapping: np.ndarray  # [R] int64 block_id * block_size + offset
    seq_lens: np.ndarray  # [m] KV length after the forward
    block_table_width: int  # blocks of the longest sequence
    logit_rows: np.ndarray  # [L] int64
    row_slot: np.ndarray  # [L] slot of each logit row
    steps: np.ndarray  # [L] sequence index of the token each logit row samples
    next_draft: np.ndarray  # [L] the draft fed at the next row, -1: none (0 while pending)
    draft_rows: np.ndarray  # [sum(num_draft)] logit rows a draft follows
    draft_in_rows: np.ndarray  # [sum(num_draft)] rows whose input is a draft
    sample_of: np.ndarray  # [k] index among the requests of each prefill chunk that samples
    drafts_pending: bool  # the drafts are still on the device: placeholders above
    # the decode rows whose input token the advanced round is still computing, and that
    # round's rows which hold those tokens
    ahead_dst: np.ndarray  # [a] int64
    ahead_src: np.ndarray  # [a] int64

    @property
    def num_rows(self) -> int:
        return int(self.group_rows[-1])

    @property
    def num_dec_rows(self) -> int:
        return int(self.group_rows[self.requests.num_decode])

    @property
    def max_q_len(self) -> int:
        return int(np.diff(self.group_rows).max())

    def preceding_drafts(self) -> list[list[int]]:
        """Per logit row the drafts fed before it in its group: they count as output there for
        penalties (they would be, if accepted). Draft rows must hold the drafts by now."""
        j, ids, num_dec_rows = self.row_in_group, self.input_ids, self.num_dec_rows
        return [
            [int(t) for t in ids[r - j[r] + 1 : r + 1]] if r < num_dec_rows else []
            for r in self.logit_rows.tolist()
        ]


def build_ragged_batch(
    plan: RoundPlan,
    requests: RoundRequests,
    table: SlotTable,
    block_size: int,
    proposal: DraftBatch | None,  # the SPEC requests' drafts; None when none speculates
    ahead_row: np.ndarray | None,  # [max_slots] the slot's row in the advanced round, -1: none
) -> RaggedBatch:
    dec, prefills = plan.decode, plan.prefills
    # [sum(num_draft)] flat in row order; None while a deferred proposal's are on the device
    drafts = np.zeros(0, dtype=np.int64)
    if proposal is not None:
        drafts = None if proposal.tokens is None else flat_drafts(proposal, plan)
    n, m = requests.num_decode, len(requests.slots)
    num_draft = dec.num_draft
    rows_per = np.concatenate([num_draft + 1, [q.num_new for q in prefills]]).astype(np.int64)
    group_rows = offsets(rows_per)  # [m + 1]
    num_dec_rows = int(group_rows[n])
    owner = np.repeat(np.arange(m), rows_per)  # [R]
    j = np.arange(int(group_rows[-1])) - group_rows[owner]  # [R]
    positions = requests.num_computed[owner] + j  # [R]
    is_draft = j[:num_dec_rows] > 0
    input_ids = _input_ids(plan, table, group_rows, is_draft, drafts)
    slot_rows = requests.slots[owner]
    bs = block_size
    slot_mapping = (
        table.block_tables[slot_rows, positions // bs].astype(np.int64) * bs + positions % bs
    )
    seq_lens = requests.num_computed + rows_per  # [m]
    # logit rows: every decode row, the last row of a prefill chunk that samples
    sample_of = np.array([n + k for k, q in enumerate(prefills) if q.sample], dtype=np.int64)
    sample_rows = group_rows[sample_of + 1] - 1
    logit_rows = np.concatenate([np.arange(num_dec_rows), sample_rows]).astype(np.int64)
    has_next = np.zeros(len(logit_rows), dtype=bool)  # [L] a draft is fed at the next row
    has_next[:num_dec_rows] = j[:num_dec_rows] < num_draft[owner[:num_dec_rows]]
    next_draft = np.full(len(logit_rows), -1, dtype=np.int64)
    next_draft[np.flatnonzero(has_next)] = 0 if drafts is None else drafts
    ahead_dst, ahead_src = _rows_from_ahead(plan, group_rows, ahead_row)
    return RaggedBatch(
        requests=requests,
        group_rows=group_rows,
        row_in_group=j,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=seq_lens,
        block_table_width=-(-int(seq_lens.max()) // bs),
        logit_rows=logit_rows,
        row_slot=slot_rows[logit_rows],
        steps=positions[logit_rows] + 1,
        next_draft=next_draft,
        draft_rows=np.flatnonzero(has_next),
        draft_in_rows=np.flatnonzero(is_draft),
        sample_of=sample_of,
        drafts_pending=drafts is None,
        ahead_dst=ahead_dst,
        ahead_src=ahead_src,
    )


def _input_ids(
    plan: RoundPlan,
    table: SlotTable,
    group_rows: np.ndarray,  # [m + 1]
    is_draft: np.ndarray,  # [decode rows] bool: the row's input is a draft
    drafts: np.ndarray | None,  # [sum(num_draft)] in row order; None: still on the device
) -> np.ndarray:
    """[R] each row's input token: a decode group's last committed token and then its drafts
    (placeholders until the device copies them in), a prefill chunk's tokens."""
    dec = plan.decode
    n = len(dec)
    input_ids = np.empty(int(group_rows[-1]), dtype=np.int64)  # [R]
    input_ids[group_rows[:n]] = table.tokens[dec.slots, table.context_len[dec.slots] - 1]
    input_ids[: len(is_draft)][is_draft] = 0 if drafts is None else drafts
    for k, q in enumerate(plan.prefills):
        a = int(group_rows[n + k])
        input_ids[a : a + q.num_new] = table.tokens[
            q.slot, q.num_computed : q.num_computed + q.num_new
        ]
    return input_ids


def flat_drafts(proposal: DraftBatch, plan: RoundPlan) -> np.ndarray:
    """The drafts of a resolved proposal flat in request (= row) order, each speculating
    request of the plan checked to have got exactly its planned number."""
    dec = plan.decode
    spec = np.flatnonzero(dec.num_draft)
    for s, d, toks in zip(dec.slots[spec].tolist(), dec.num_draft[spec].tolist(), proposal.tokens):
        if len(toks) != d:
            raise RuntimeError(f"slot {s}: plan has {d} drafts, the drafter gave {len(toks)}")
    return np.asarray([t for toks in proposal.tokens for t in toks], dtype=np.int64)


def _rows_from_ahead(
    plan: RoundPlan, group_rows: np.ndarray, ahead_row: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(rows of this round, rows of the advanced round) for the decode requests whose input
    token the advanced round samples on the device."""
    if ahead_row is None:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    dec = plan.decode
    src = ahead_row[dec.slots]
    from_dev = np.flatnonzero(src >= 0)
    if len(from_dev) and dec.num_draft[from_dev].any():
        raise RuntimeError(
            "a speculative row for a request whose last token is still on the device"
        )
    return group_rows[from_dev], src[from_dev]


@dataclass(frozen=True)
class DeviceBatch:
    """A round's rows on the device: views of its one upload."""

    ids: torch.Tensor  # [R] int64
    meta: AttnMetadata
    logit_rows: torch.Tensor | None  # [L] int64; None when every row has logits
    next_draft: torch.Tensor  # [L] int64
    draft_rows: torch.Tensor | None  # [sum(num_draft)]; only with draft distributions
    sampling: SamplingTensors


def upload_batch(
    buffer: HostBuffer,
    batch: RaggedBatch,
    table: SlotTable,
    proposal: DraftBatch | None,
    ahead_tokens: torch.Tensor | None,  # the advanced round's tokens on the device
) -> DeviceBatch:
    """Packs the batch into `buffer` and uploads it; then, in stream order, copies in the
    drafts a pending proposal makes on the device and the advanced round's tokens."""
    row_slot = batch.row_slot
    packed = PackedSampling.pack(
        table.float_params[:, row_slot],
        table.greedy[row_slot],
        table.top_k[row_slot],
        table.seed[row_slot],
        batch.steps,
        table.penalised[row_slot],
    )
    with_probs = proposal is not None and proposal.probs is not None
    _pack(buffer, batch, table, packed, with_probs)
    dev = buffer.upload()
    if batch.drafts_pending:
        dev["ids"].index_copy_(0, dev["draft_in_rows"], proposal.tokens_dev)
        dev["next_draft"].index_copy_(0, dev["draft_rows"], proposal.tokens_dev)
    if "ahead_dst" in dev:
        dev["ids"].index_copy_(0, dev["ahead_dst"], ahead_tokens.index_select(0, dev["ahead_src"]))
    meta = AttnMetadata(
        positions=dev["positions"],
        slot_mapping=dev["slot_mapping"],
        cu_q_lens=dev["cu_q_lens"],
        seq_lens=dev["seq_lens"],
        block_tables=dev["block_tables"],
        max_q_len=batch.max_q_len,
    )
    sampling = SamplingTensors.from_packed(
        packed,
        dev["float_params"],
        dev["int_params"],
        dev["greedy"],
        dev.get("sampled_rows"),
        table.vocab_size,
    )
    return DeviceBatch(
        ids=dev["ids"],
        meta=meta,
        logit_rows=dev.get("logit_rows"),
        next_draft=dev["next_draft"],
        draft_rows=dev["draft_rows"] if with_probs else None,
        sampling=sampling,
    )


def _pack(
    buffer: HostBuffer,
    batch: RaggedBatch,
    table: SlotTable,
    packed: PackedSampling,
    with_probs: bool,  # the drafts come with their distributions
) -> None:
    """Every array of the round into the host buffer, each under the name its device view
    takes; arrays the round does not need are left out."""
    slots = batch.requests.slots
    buffer.start()
    buffer.add("ids", batch.input_ids, np.int64)
    buffer.add("positions", batch.positions, np.int64)
    buffer.add("slot_mapping", batch.slot_mapping, np.int64)
    buffer.add("cu_q_lens", batch.group_rows, np.int32)
    buffer.add("seq_lens", batch.seq_lens, np.int32)
    buffer.add("block_tables", table.block_tables[slots, : batch.block_table_width], np.int32)
    if len(batch.logit_rows) < batch.num_rows:
        buffer.add("logit_rows", batch.logit_rows, np.int64)
    if len(batch.ahead_dst):
        buffer.add("ahead_dst", batch.ahead_dst, np.int64)
        buffer.add("ahead_src", batch.ahead_src, np.int64)
    buffer.add("float_params", packed.floats, np.float32)
    buffer.add("greedy", packed.greedy, np.bool_)
    buffer.add("int_params", packed.ints, np.int64)
    buffer.add("next_draft", batch.next_draft, np.int64)
    if packed.mixed:
        buffer.add("sampled_rows", packed.sampled_rows, np.int64)
    if with_probs or batch.drafts_pending:  # the logit rows the drafts (and their q) belong to
        buffer.add("draft_rows", batch.draft_rows, np.int64)
    if batch.drafts_pending:
        buffer.add("draft_in_rows", batch.draft_in_rows, np.int64)
