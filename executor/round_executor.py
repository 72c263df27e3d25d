"""The one-pass round executor: runs a `RoundPlan` as one target forward and returns a
`RoundResult`.

Per round:
1. apply releases and set-ups (per-slot host state, drafter state);
2. drafters propose tokens for the SPEC requests (batched);
3. build one ragged batch in plan order: decode rows (the AR row or the SPEC group: last
   committed token + drafts, straight from the plan's columns), then PREFILL chunks, padded to
   the plan's row bucket. The host side is numpy over the columns, written into one pinned
   buffer and uploaded with ONE non-blocking copy (ids, positions, slot mapping, cu lens, seq
   lens, block-table rows, sampling parameters);
4. one target forward over all rows; K/V written into the paged cache in place;
5. accept on the device (greedy match or exact rejection sampling); one copy of the per-row
   results to the host;
6. commit by advancing each slot's committed length: accepted K/V were written by the verify pass
   itself, rejected rows lie past the end. No second pass, no copy.

`launch(plan)` does 1-5 up to the start of that copy without waiting for the device;
`finish(pending)` waits for the copy, walks the accepted prefixes (array work) and commits. The
engine does the previous round's per-output work in between. `run = finish(launch(plan))`.

Rounds ahead: an AR-only decode round (no drafts, no prefill, no penalties or logprobs) can be
`advance`d once launched: each of its requests is then taken to have computed one more token, and
the next round may be launched before this one finishes. That next round's rows for those
requests read their input token straight from this round's sampled tokens on the device, so the
host's work between rounds (finish, the scheduler's update and plan, the batch build) overlaps the
device's forward instead of leaving it idle. Rounds still finish in launch order.

Invariant per decoding slot: `num_computed == len(context) - 1` (the last token's KV is written by
the round that feeds it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from executor.accept import AcceptLaunch, finish_accept, launch_accept, logprobs_of, walk_groups
from executor.drafters.base import DraftBatch, Drafter, DraftRequest
from executor.graphs import DEFAULT_BUCKETS, DecodeGraphs, bucket_for
from executor.kv_cache import KVCache
from executor.model import AttnMetadata, Model
from executor.row_sampler import RowSampler
from executor.sampling import SamplingTensors, sampling_row
from scheduler.plan import (
    Emitted,
    PhaseTimes,
    RoundPlan,
    RoundResult,
    SamplingSpec,
    offsets,
)

_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


class _HostBuffer:
    """One round's inputs packed into a (pinned on a GPU, double-buffered) host byte buffer and
    uploaded with one non-blocking copy into a persistent device buffer. Every array starts on
    a 16-byte boundary: Triton specialises a kernel on whether each pointer is 16-byte aligned,
    so arrays packed back to back would compile new variants as row counts change (seconds
    each, inside a serving round). The device views are cached per layout, so a steady run of
    same-shaped rounds creates no tensors at all; reusing the device buffer is safe because the
    copy is ordered on the stream after the previous round's kernels."""

    ALIGN = 16

    def __init__(self, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self.pinned = pinned
        self.bufs: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        self.dev_buf = torch.empty(0, dtype=torch.uint8, device=device)
        self.which = 0
        self.items: list[tuple[str, np.ndarray]] = []
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}

    def start(self) -> None:
        self.items = []
        self.which ^= 1

    def add(self, name: str, values: np.ndarray, dtype) -> None:
        self.items.append((name, np.ascontiguousarray(values, dtype=dtype)))

    def upload(self) -> dict[str, torch.Tensor]:
        align = self.ALIGN
        starts = []
        size = 0
        for _, v in self.items:
            starts.append(size)
            size += -(-v.nbytes // align) * align
        buf = self.bufs[self.which]
        if buf.numel() < size:
            buf = torch.empty(
                max(size, 2 * buf.numel(), 4096), dtype=torch.uint8, pin_memory=self.pinned
            )
            self.bufs[self.which] = buf
        host = buf.numpy()
        for (_, v), start in zip(self.items, starts):
            host[start : start + v.nbytes] = v.reshape(-1).view(np.uint8)
        if self.dev_buf.numel() < size:
            self.dev_buf = torch.empty(buf.numel(), dtype=torch.uint8, device=self.device)
            self._views = {}
        self.dev_buf[:size].copy_(buf[:size], non_blocking=True)  # the one host -> device copy
        key = tuple((name, v.shape, v.dtype.char) for name, v in self.items)
        views = self._views.get(key)
        if views is None:
            views = {}
            for (name, v), start in zip(self.items, starts):
                flat = self.dev_buf[start : start + v.nbytes].view(_TORCH_DTYPE[v.dtype.char])
                views[name] = flat if v.ndim == 1 else flat.view(v.shape)
            if len(self._views) > 256:  # shapes drift with contexts: keep the cache small
                self._views = {}
            self._views[key] = views
        return views


_TORCH_DTYPE = {
    np.dtype(np.int64).char: torch.int64,
    np.dtype(np.int32).char: torch.int32,
    np.dtype(np.float32).char: torch.float32,
    np.dtype(np.bool_).char: torch.bool,
}


@dataclass
class PendingRound:
    """A launched round: everything `finish` needs once the device is done."""

    plan: RoundPlan
    t0: float
    t_draft0: float = 0.0
    t_build0: float = 0.0
    t_fwd0: float = 0.0
    t_acc0: float = 0.0
    t_launched: float = 0.0
    slots: np.ndarray | None = None  # [m] slot of every planned request in row order
    input_ids: np.ndarray | None = None  # [R]
    # [sum(num_draft)] rows whose input is a draft, when the drafts reached the batch on the
    # device (deferred): `input_ids` holds placeholders there until `finish`
    draft_in_rows: np.ndarray | None = None
    group_rows: np.ndarray | None = None  # [m + 1] row starts
    sample_of: np.ndarray | None = None  # [same] index of those chunks among the requests
    accept: AcceptLaunch | None = None
    drafts: DraftBatch | None = None
    fwd_events: tuple | None = None
    num_rows: int = 0
    num_padded: int = 0
    num_kv_tokens: int = 0
    bucket: int = 0
    greedy_dev: torch.Tensor | None = None  # [L] bool on the device: the row decodes greedily
    overlapped: bool = False  # a later round was launched before this one finished
    behind: bool = False  # launched while an advanced round was still running
    # on a GPU: recorded when the launch starts and after its last device work (the acceptance)
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    # advanced (see `RoundExecutor.advance`): [n] the token each row emits, on the device
    tokens_dev: torch.Tensor | None = None


class RoundExecutor:
    def __init__(
        self,
        target: Model,
        *,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        max_model_len: int,
        drafter: Drafter | None = None,
        base_seed: int = 0,
        sync_phases: bool = False,
        graphs: str = "off",
        max_graph_rows: int = 512,
        drafter_follows_prefill: bool = False,
    ):
        self.target = target
        self.device = target.device
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size) + 1
        self.kv = KVCache.allocate(
            target.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=target.dtype,
            device=target.device,
        )
        self.drafter = drafter
        self.drafter_follows_prefill = drafter_follows_prefill  # asked for (see follow_prefill)
        self.vocab_size = target.config.vocab_size
        # Per-slot host state, one row per slot.
        self.slot_req = np.full(max_slots, -1, dtype=np.int64)  # req_id, -1: free
        self.num_computed = np.zeros(max_slots, dtype=np.int64)
        self.context_len = np.zeros(max_slots, dtype=np.int64)  # prompt + committed outputs
        self.tokens = np.zeros((max_slots, max_model_len + 1), dtype=np.int32)  # contexts
        self.float_params = np.zeros((len(_FLOAT_PARAMS), max_slots), dtype=np.float32)
        self.top_k = np.zeros(max_slots, dtype=np.int64)  # vocab size when off
        self.seed = np.zeros(max_slots, dtype=np.int64)
        self.greedy = np.ones(max_slots, dtype=bool)
        self.penalised = np.zeros(max_slots, dtype=bool)
        self.logprobs_k = np.full(max_slots, -1, dtype=np.int64)  # -1: no logprobs
        # Host mirror of each slot's block table; the rows a round touches are uploaded at once.
        self.block_tables = np.zeros((max_slots, self.max_blocks_per_seq), dtype=np.int32)
        if drafter is not None and hasattr(drafter, "bind_block_tables"):
            # a model drafter keeps its KV under the same block ids: it reads this table
            drafter.bind_block_tables(self.block_tables)
        # The advanced round in flight, and per slot its row there (-1: none).
        self._ahead: PendingRound | None = None
        self._ahead_row = np.full(max_slots, -1, dtype=np.int64)
        self._last_end = 0.0  # when the last finish() ended (the period of overlapped rounds)
        self._last_end_event = None  # the last finished round's end_event (GPU)
        self.sampler = RowSampler(target.config.vocab_size, self.device, base_seed, max_slots)
        self.base_seed = base_seed
        self.sync_phases = sync_phases and self.device.type == "cuda"
        self._host = _HostBuffer(self.device)
        self.graphs: DecodeGraphs | None = None
        if graphs != "off" and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                target,
                self.kv.k,
                self.kv.v,
                max_seqs=max_slots,
                max_blocks_per_seq=self.max_blocks_per_seq,
                max_rows=min(max_graph_rows, DEFAULT_BUCKETS[-1]),
            )
            if graphs == "startup":
                for b in DEFAULT_BUCKETS:
                    if b > self.graphs.max_rows:
                        break
                    self.graphs.capture(b, self.graphs.width_for(1))

    # -- slot bookkeeping ---------------------------------------------------------------------
    def _apply_setup_release(self, plan: RoundPlan) -> None:
        for slot in plan.release:
            self.slot_req[slot] = -1
            self._ahead_row[slot] = -1
            self.sampler.release_slot(slot)
            if self.drafter is not None:
                self.drafter.release(slot)
        for s in plan.setup:
            context = list(s.context_token_ids)
            slot = s.slot
            if len(context) > self.tokens.shape[1]:
                raise ValueError(f"slot {slot}: context of {len(context)} tokens exceeds the limit")
            prompt_len = len(context) - s.num_output_tokens
            self.slot_req[slot] = s.req_id
            self._ahead_row[slot] = -1
            self.num_computed[slot] = 0
            self.context_len[slot] = len(context)
            self.tokens[slot, : len(context)] = context
            self._set_sampling(slot, s.req_id, s.sampling)
            self.sampler.setup_slot(slot, context, prompt_len, s.sampling)
            if self.drafter is not None:
                self.drafter.setup(slot, context)

    def _set_sampling(self, slot: int, req_id: int, spec: SamplingSpec) -> None:
        """The slot's sampling parameters as the per-row values `SamplingTensors` holds."""
        row, self.top_k[slot], self.seed[slot] = sampling_row(
            spec, req_id, self.base_seed, self.vocab_size
        )
        self.float_params[:, slot] = row
        self.greedy[slot] = spec.greedy
        self.penalised[slot] = (
            spec.presence_penalty != 0.0
            or spec.frequency_penalty != 0.0
            or spec.repetition_penalty != 1.0
        )
        self.logprobs_k[slot] = -1 if spec.logprobs is None else spec.logprobs

    def context(self, slot: int) -> np.ndarray:
        """The slot's committed context (prompt + outputs), a view."""
        return self.tokens[slot, : self.context_len[slot]]

    def rewind(self, slot: int, context_len: int, num_computed: int | None = None) -> None:
        """Forgets the slot's tokens past `context_len` (committed length `num_computed`,
        default `context_len - 1`): benchmarks re-run one round from the same state with it."""
        self.context_len[slot] = context_len
        self.num_computed[slot] = context_len - 1 if num_computed is None else num_computed

    def _sync(self) -> None:
        if self.sync_phases:
            torch.cuda.synchronize(self.device)

    # -- one round ----------------------------------------------------------------------------
    def run(self, plan: RoundPlan) -> RoundResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: RoundPlan) -> PendingRound:
        """Applies set-ups and releases, drafts, builds the batch and enqueues the forward and
        the acceptance without waiting for the device."""
        p = PendingRound(plan=plan, t0=time.perf_counter())
        if self.device.type == "cuda":
            p.start_event = torch.cuda.Event(enable_timing=True)
            p.start_event.record()
        self._apply_setup_release(plan)
        dec, prefills = plan.decode, plan.prefills
        n = len(dec)
        m = n + len(prefills)
        if m == 0:
            return p
        slots = np.concatenate([dec.slots, [q.slot for q in prefills]]).astype(np.int64)
        req_ids = np.concatenate([dec.req_ids, [q.req_id for q in prefills]]).astype(np.int64)
        computed = np.concatenate([dec.num_computed, [q.num_computed for q in prefills]])
        computed = computed.astype(np.int64)
        bad = np.flatnonzero(
            (self.slot_req[slots] != req_ids) | (self.num_computed[slots] != computed)
        )
        if len(bad):
            i = int(bad[0])
            s = int(slots[i])
            raise RuntimeError(
                f"plan/executor state mismatch for req {req_ids[i]} in slot {s}: executor has "
                f"req {self.slot_req[s]} at {self.num_computed[s]} tokens, plan says {computed[i]}"
            )
        # new KV block ids into the slots' table rows
        counts = np.diff(dec.block_starts)
        if len(dec.new_block_ids):
            owner = np.repeat(np.arange(n), counts)
            col = (
                dec.block_offset[owner]
                + np.arange(len(dec.new_block_ids))
                - dec.block_starts[owner]
            )
            self.block_tables[dec.slots[owner], col] = dec.new_block_ids
        for q in prefills:
            if q.new_block_ids:
                self.block_tables[
                    q.slot, q.block_offset : q.block_offset + len(q.new_block_ids)
                ] = q.new_block_ids

        # 2. drafts
        p.t_draft0 = time.perf_counter()
        num_draft = dec.num_draft
        spec = np.flatnonzero(num_draft)
        drafts_flat = np.zeros(0, dtype=np.int64)  # None while the drafts are on the device
        if len(spec):
            if self.drafter is None:
                raise RuntimeError("plan has SPEC requests but the executor has no drafter")
            spec_slots = dec.slots[spec]
            # Deferred: a drafter working on the device returns before its drafts reach the
            # host; the batch below is built meanwhile and the drafts are copied into its rows
            # on the device, so the forward follows the chain without a wait. Penalties count
            # the drafts on the host at launch, so a round with any takes them at once.
            p.drafts = self.drafter.propose(
                [
                    DraftRequest(s, self.context(s), d, temperature=float(self.float_params[0, s]))
                    for s, d in zip(spec_slots.tolist(), num_draft[spec].tolist())
                ],
                [bool(self.greedy[s]) for s in spec_slots.tolist()],
                defer=True,
            )
            if p.drafts.tokens is None and self.penalised[slots].any():
                p.drafts.resolve()
            drafts_flat = None if p.drafts.tokens is None else _flat_drafts(p.drafts, dec)
        self._sync()
        p.t_build0 = time.perf_counter()

        # 3. the ragged batch: decode groups, then prefill chunks
        rows_per = np.concatenate([num_draft + 1, [q.num_new for q in prefills]]).astype(np.int64)
        group_rows = offsets(rows_per)  # [m + 1]
        num_rows = int(group_rows[-1])
        num_dec_rows = int(group_rows[n])
        owner = np.repeat(np.arange(m), rows_per)  # [R]
        j = np.arange(num_rows) - group_rows[owner]  # [R]
        positions = computed[owner] + j  # [R]
        input_ids = np.empty(num_rows, dtype=np.int64)  # [R]
        dec_slots = dec.slots
        input_ids[group_rows[:n]] = self.tokens[dec_slots, self.context_len[dec_slots] - 1]
        # rows whose input token is still on the device (sampled by the advanced round)
        ahead_src = self._ahead_row[dec_slots] if self._ahead is not None else None
        ahead_dst = None
        if ahead_src is not None:
            from_dev = np.flatnonzero(ahead_src >= 0)
            if len(from_dev) and num_draft[from_dev].any():
                raise RuntimeError(
                    "a speculative row for a request whose last token is still on the device"
                )
            ahead_src = ahead_src[from_dev]
            ahead_dst = group_rows[from_dev]
        is_draft = j[:num_dec_rows] > 0
        deferred = drafts_flat is None
        # drafts in request order = row order (placeholders until the device copies them in)
        input_ids[:num_dec_rows][is_draft] = 0 if deferred else drafts_flat
        for k, q in enumerate(prefills):
            a = int(group_rows[n + k])
            input_ids[a : a + q.num_new] = self.tokens[
                q.slot, q.num_computed : q.num_computed + q.num_new
            ]
        slot_rows = slots[owner]
        bs = self.block_size
        slot_mapping = (
            self.block_tables[slot_rows, positions // bs].astype(np.int64) * bs + positions % bs
        )
        seq_lens = computed + rows_per  # [m]
        max_blocks = -(-int(seq_lens.max()) // bs)
        # logit rows: every decode row, the last row of a prefill chunk that samples
        sample_of = np.array([n + k for k, q in enumerate(prefills) if q.sample], dtype=np.int64)
        sample_rows = group_rows[sample_of + 1] - 1
        logit_rows = np.concatenate([np.arange(num_dec_rows), sample_rows]).astype(np.int64)
        num_logit = len(logit_rows)
        # per logit row: slot, step (sequence index of the token it samples), next draft
        row_slot = slot_rows[logit_rows]
        steps = positions[logit_rows] + 1
        next_draft = np.full(num_logit, -1, dtype=np.int64)
        has_next = np.zeros(num_logit, dtype=bool)
        has_next[:num_dec_rows] = j[:num_dec_rows] < num_draft[owner[:num_dec_rows]]
        next_draft[np.flatnonzero(has_next)] = 0 if deferred else drafts_flat
        host = self._host
        host.start()
        host.add("ids", input_ids, np.int64)
        host.add("positions", positions, np.int64)
        host.add("slot_mapping", slot_mapping, np.int64)
        host.add("cu_q_lens", group_rows, np.int32)
        host.add("seq_lens", seq_lens, np.int32)
        host.add("block_tables", self.block_tables[slots, :max_blocks], np.int32)
        if num_logit < num_rows:
            host.add("logit_rows", logit_rows, np.int64)
        if ahead_dst is not None and len(ahead_dst):
            host.add("ahead_dst", ahead_dst, np.int64)
            host.add("ahead_src", ahead_src, np.int64)
        row_greedy = self.greedy[row_slot]  # [L]
        floats = self.float_params[:, row_slot]  # [6, L]
        # greedy rows divide by 1.0 so that the division stays finite
        floats[0] = np.where(row_greedy, np.float32(1.0), floats[0])
        host.add("float_params", floats, np.float32)
        host.add("greedy", row_greedy, np.bool_)
        host.add(
            "int_params", np.stack([self.top_k[row_slot], self.seed[row_slot], steps]), np.int64
        )
        host.add("next_draft", next_draft, np.int64)
        sampled = np.flatnonzero(~row_greedy)
        mixed = 0 < len(sampled) < num_logit
        if mixed:
            host.add("sampled_rows", sampled, np.int64)
        with_probs = p.drafts is not None and p.drafts.probs is not None
        if with_probs or deferred:  # the logit rows the drafts (and distributions) belong to
            host.add("draft_rows", np.flatnonzero(has_next), np.int64)
        if deferred:  # the rows whose input is a draft
            p.draft_in_rows = np.flatnonzero(is_draft)
            host.add("draft_in_rows", p.draft_in_rows, np.int64)
        dev = host.upload()
        if deferred:  # after the upload, in stream order: the drafts from the chain's output
            dev["ids"].index_copy_(0, dev["draft_in_rows"], p.drafts.tokens_dev)
            dev["next_draft"].index_copy_(0, dev["draft_rows"], p.drafts.tokens_dev)
        if self._ahead is not None:
            self._ahead.overlapped = True
            p.behind = True
        if "ahead_dst" in dev:  # after the upload, in stream order: the tokens of the round ahead
            dev["ids"].index_copy_(
                0, dev["ahead_dst"], self._ahead.tokens_dev.index_select(0, dev["ahead_src"])
            )
        meta = AttnMetadata(
            positions=dev["positions"],
            slot_mapping=dev["slot_mapping"],
            cu_q_lens=dev["cu_q_lens"],
            seq_lens=dev["seq_lens"],
            block_tables=dev["block_tables"],
            max_q_len=int(rows_per.max()),
        )
        st = self._sampling_tensors(dev, row_slot, row_greedy, mixed)
        bucket = 0
        if self.graphs is not None and plan.is_decode_only:
            # The plan's bucket (the cost model's shape) when it fits the captured range, else
            # the executor's own; rounds larger than any graph run eagerly.
            bucket = plan.row_bucket
            if not num_rows <= bucket <= self.graphs.max_rows:
                bucket = bucket_for(num_rows)
            if bucket > self.graphs.max_rows:
                bucket = 0
        self._sync()
        p.t_fwd0 = time.perf_counter()
        if self.device.type == "cuda":
            p.fwd_events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            p.fwd_events[0].record()

        # 4. one target forward (graph replay for decode rounds)
        if bucket:
            logits = self.graphs.replay(bucket, dev["ids"], meta)
        else:
            hidden = self.target.forward(dev["ids"], meta, self.kv.k, self.kv.v)  # [rows, hidden]
            if num_logit < num_rows:
                hidden = hidden[dev["logit_rows"]]
            logits = self.target.logits(hidden)  # [num_logit, vocab]
        if p.fwd_events is not None:
            p.fwd_events[1].record()
        self._sync()
        p.t_acc0 = time.perf_counter()

        # 5. acceptance on the device, one copy of its per-row results started
        draft_rows = dev["draft_rows"] if with_probs else None
        preceding = None
        if st.use_penalties:  # the drafts before each row count as output there
            preceding = [
                [int(t) for t in input_ids[r - j[r] + 1 : r + 1]] if r < num_dec_rows else []
                for r in logit_rows.tolist()
            ]
        p.accept = launch_accept(
            logits,
            st,
            self.sampler,
            row_slot,
            preceding,
            dev["next_draft"],
            p.drafts.probs if p.drafts is not None else None,
            draft_rows,
        )
        p.slots, p.input_ids, p.group_rows = slots, input_ids, group_rows
        p.greedy_dev = st.greedy
        p.sample_of = sample_of
        p.num_rows = num_rows
        p.num_padded = bucket or num_rows
        p.num_kv_tokens = int(seq_lens.sum())
        p.bucket = bucket
        if plan.follow_prefill and self.follow_prefill and prefills:
            # after the target's forward: on a GPU these launches overlap its device time
            starts = [q.num_computed for q in prefills]
            self.drafter.follow_prefill(
                [q.slot for q in prefills],
                starts,
                [self.tokens[q.slot, a : a + q.num_new] for q, a in zip(prefills, starts)],
            )
        if p.start_event is not None:
            p.end_event = torch.cuda.Event(enable_timing=True)
            p.end_event.record()
        p.t_launched = time.perf_counter()
        return p

    @property
    def follow_prefill(self) -> bool:
        """Whether the drafter may compute prefill chunks' draft KV in their rounds: asked for,
        and the drafter (which a benchmark may swap) can. A round's plan says whether it does
        (`RoundPlan.follow_prefill`)."""
        return self.drafter_follows_prefill and bool(
            getattr(self.drafter, "follows_prefill", False)
        )

    def can_advance(self, p: PendingRound) -> bool:
        """Whether the next round may be launched before `p` finishes: `p` is AR rows only
        (no drafts, no prefill) whose tokens need nothing of the host (no penalties, whose
        counts are committed on the host, and no logprobs, read from the logits the next
        round's graph replay overwrites), and no other round is ahead."""
        plan = p.plan
        if self._ahead is not None or p.accept is None or plan.prefills:
            return False
        slots = p.slots
        return (
            len(slots) > 0
            and not plan.decode.num_draft.any()
            and not self.penalised[slots].any()
            and bool((self.logprobs_k[slots] < 0).all())
        )

    def advance(self, p: PendingRound) -> None:
        """Takes every request of the launched AR round `p` to have computed one more token, so
        the next round can be launched before `p` finishes (its input tokens are gathered from
        `p`'s sampled tokens on the device). `finish(p)` must still come before the next round's
        finish."""
        if not self.can_advance(p):
            raise RuntimeError(f"round {p.plan.round_id} cannot be advanced")
        acc = p.accept
        n = len(p.slots)
        tokens = acc.packed_dev[0, :n]  # [n] greedy argmax
        if acc.has_draws:
            tokens = torch.where(p.greedy_dev[:n], tokens, acc.packed_dev[1, :n])
        p.tokens_dev = tokens
        self.num_computed[p.slots] += 1
        self._ahead = p
        self._ahead_row[p.slots] = np.arange(n)

    def _sampling_tensors(self, dev, row_slot, greedy, mixed) -> SamplingTensors:
        """The rows' sampling parameters on the device, as views of the round's one upload."""
        floats = dev["float_params"]  # [6, L]
        ints = dev["int_params"]  # [3, L]
        sampled_slots = row_slot[~greedy]
        top_k = self.top_k[sampled_slots]
        top_ks = top_k[top_k < self.vocab_size]
        all_greedy = len(sampled_slots) == 0
        return SamplingTensors(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            presence_penalty=floats[3],
            frequency_penalty=floats[4],
            repetition_penalty=floats[5],
            top_k=ints[0],
            seed=ints[1],
            step=ints[2],
            greedy=dev["greedy"],
            sampled_rows=dev["sampled_rows"] if mixed else None,
            num_rows=len(row_slot),
            all_greedy=all_greedy,
            any_greedy=len(sampled_slots) < len(row_slot),
            use_top_k=len(top_ks) > 0,
            use_top_p=not all_greedy and bool((self.float_params[1, sampled_slots] < 1.0).any()),
            use_min_p=not all_greedy and bool((self.float_params[2, sampled_slots] > 0.0).any()),
            use_penalties=bool(self.penalised[row_slot].any()),
            max_top_k=int(top_ks.max(initial=0)),
        )

    def finish(self, p: PendingRound) -> RoundResult:
        """Waits for the acceptance copy, walks the accepted prefixes and commits."""
        plan = p.plan
        if p.accept is None:
            return RoundResult(
                round_id=plan.round_id,
                out=Emitted.build((), (), (), (), ()),
                timings=PhaseTimes(),
                num_rows=0,
                num_padded_rows=0,
                num_kv_tokens=0,
            )
        dec = plan.decode
        n = len(dec)
        advanced = p.tokens_dev is not None
        if self._ahead is not None and not advanced:
            raise RuntimeError("rounds finish in launch order: the advanced round comes first")
        if advanced:  # its one token per request was counted by advance()
            self._ahead = None
            self._ahead_row.fill(-1)
        t_wait0 = time.perf_counter()
        host = finish_accept(p.accept)  # the one wait for the device
        if p.drafts is not None:  # a deferred proposal's drafts (their copy came first)
            p.drafts.resolve()
            if p.draft_in_rows is not None:
                p.input_ids[p.draft_in_rows] = _flat_drafts(p.drafts, dec)
        t_commit0 = time.perf_counter()
        slots = p.slots
        m = len(slots)
        greedy = self.greedy[slots]
        forced = None
        if p.drafts is not None and p.drafts.forced_accept is not None:
            forced = np.zeros(n, dtype=np.int64)
            forced[np.flatnonzero(dec.num_draft)] = p.drafts.forced_accept
        num_accepted, emitted_dec, tokens_dec = walk_groups(
            host,
            p.input_ids,
            p.group_rows[: n + 1],
            dec.num_draft,
            greedy[:n],
            p.accept.has_rejection,
            forced,
        )
        # prefill chunks: the token sampled at their last row, none for a partial chunk
        num_emitted = np.zeros(m, dtype=np.int64)
        num_emitted[:n] = emitted_dec
        accepted = np.zeros(m, dtype=np.int64)
        accepted[:n] = num_accepted
        num_dec_rows = int(p.group_rows[n])
        logit_of_sample = num_dec_rows + np.arange(len(p.sample_of))
        which = np.where(greedy[p.sample_of], 0, 1)
        sample_tokens = host[which, logit_of_sample] if len(p.sample_of) else np.zeros(0, np.int64)
        num_emitted[p.sample_of] = 1
        tokens = np.concatenate([tokens_dec, sample_tokens]).astype(np.int64)

        # 6. commit: committed lengths, contexts, counters, for the slots the round's requests
        # still hold (a slot released since the launch of an advanced round has moved on)
        req_ids = np.concatenate([dec.req_ids, [q.req_id for q in plan.prefills]])
        own = self.slot_req[slots] == req_ids  # [m]
        is_dec = np.arange(m) < n
        rows_per = np.diff(p.group_rows)
        if not advanced:
            grown = np.where(is_dec, 1 + accepted, rows_per)
            self.num_computed[slots] += np.where(own, grown, 0)
        starts = offsets(num_emitted)
        kept = np.where(own, num_emitted, 0)
        tok_owner = np.repeat(np.arange(m), num_emitted)
        tok_slot = slots[tok_owner]
        tok_pos = self.context_len[tok_slot] + np.arange(len(tokens)) - starts[tok_owner]
        tok_own = own[tok_owner]
        if tok_own.any() and int(tok_pos[tok_own].max()) >= self.tokens.shape[1]:
            raise RuntimeError("a slot's context grew past the executor's max_model_len")
        self.tokens[tok_slot[tok_own], tok_pos[tok_own]] = tokens[tok_own]
        self.context_len[slots] += kept
        for i in np.flatnonzero(self.penalised[slots] & (kept > 0)).tolist():
            self.sampler.commit(int(slots[i]), tokens[starts[i] : starts[i + 1]].tolist())
        if self.drafter is not None:
            # drafters only hear about rounds in which they drafted: AR and prefill tokens
            # reach them through the context at their next proposal
            for i in np.flatnonzero((dec.num_draft > 0) & own[:n]).tolist():
                s = int(slots[i])
                self.drafter.commit(s, self.context(s), int(num_accepted[i]), int(dec.num_draft[i]))
        logprobs = self._logprobs(p, starts, tokens, num_emitted)
        drafted = np.zeros(m, dtype=np.int64)
        drafted[:n] = dec.num_draft
        out = Emitted.build(req_ids, num_emitted, tokens, drafted, accepted, logprobs)
        t_end = time.perf_counter()
        ms = 1e3
        timings = PhaseTimes(
            build_ms=(p.t_fwd0 - p.t_build0 + p.t_draft0 - p.t0) * ms,
            draft_ms=(p.t_build0 - p.t_draft0) * ms,
            catchup_ms=p.drafts.catchup_ms if p.drafts is not None else 0.0,
            draft_wait_ms=p.drafts.extra.get("wait_ms", 0.0) if p.drafts is not None else 0.0,
            # device time of the forward where events exist (host time otherwise)
            forward_ms=(
                p.fwd_events[0].elapsed_time(p.fwd_events[1])
                if p.fwd_events is not None
                else (p.t_acc0 - p.t_fwd0) * ms
            ),
            # launching the acceptance, then waiting for its copy (the device's remaining work)
            accept_ms=(p.t_launched - p.t_acc0 + t_commit0 - t_wait0) * ms,
            commit_ms=(t_end - t_commit0) * ms,
            total_ms=self._period_ms(p, t_end),
        )
        self._last_end = t_end
        self._last_end_event = p.end_event
        return RoundResult(
            round_id=plan.round_id,
            out=out,
            timings=timings,
            num_rows=p.num_rows,
            num_padded_rows=p.num_padded,
            num_kv_tokens=p.num_kv_tokens,
            graph_replayed=bool(p.bucket),
            overlapped=p.overlapped,
        )

    def _period_ms(self, p: PendingRound, t_end: float) -> float:
        """The round's share of the wall time. On the host: from its launch, or from the previous
        finish for a round launched before it. Where rounds overlap on a GPU, on the device's
        timeline instead: from the previous round's end (a round launched behind it) or from
        its own launch (a round another was launched behind) to its own end. On the host
        either would also count the host time its neighbour's launch took: an eager prefill
        chunk launched behind an AR round holds the host for ~30 ms on the H200, which was
        charged to the AR round (6x its price; the AR correction rose to 1.4-1.7 and the
        policy speculated against an AR price 40-70% too high), and the chunk's round, whose
        device work was done by then, measured 2 ms."""
        host_ms = (t_end - max(p.t0, self._last_end)) * 1e3
        if p.end_event is None or not (p.behind or p.overlapped):
            return host_ms
        start = self._last_end_event if p.behind else p.start_event
        if start is None:
            return host_ms
        p.end_event.synchronize()  # (the acceptance copy was waited for: done or nearly)
        return float(start.elapsed_time(p.end_event))

    def _logprobs(self, p: PendingRound, starts, tokens, num_emitted) -> dict:
        """Logprobs of the emitted tokens for the requests that asked (one more device op)."""
        ks = self.logprobs_k[p.slots]
        asking = np.flatnonzero((ks >= 0) & (num_emitted > 0))
        if not len(asking):
            return {}
        n = len(p.plan.decode)
        num_dec_rows = int(p.group_rows[n])
        rows, ids, kk, owners = [], [], [], []
        for i in asking.tolist():
            first = (
                int(p.group_rows[i])
                if i < n
                else num_dec_rows + int(np.flatnonzero(p.sample_of == i)[0])
            )
            for k in range(int(num_emitted[i])):
                rows.append(first + k)
                ids.append(int(tokens[starts[i] + k]))
                kk.append(int(ks[i]))
                owners.append(i)
        lps = logprobs_of(p.accept.logits, rows, ids, kk)
        out: dict[int, list] = {}
        for i, lp in zip(owners, lps):
            out.setdefault(i, []).append(lp)
        return {i: tuple(v) for i, v in out.items()}


def _flat_drafts(drafts: DraftBatch, dec) -> np.ndarray:
    """The drafts of a resolved batch flat in request (= row) order, each speculating request
    of `dec` checked to have got exactly its planned number."""
    spec = np.flatnonzero(dec.num_draft)
    for s, d, toks in zip(dec.slots[spec].tolist(), dec.num_draft[spec].tolist(), drafts.tokens):
        if len(toks) != d:
            raise RuntimeError(f"slot {s}: plan has {d} drafts, the drafter gave {len(toks)}")
    return np.asarray([t for toks in drafts.tokens for t in toks], dtype=np.int64)
