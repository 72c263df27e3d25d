"""The one-pass round executor: runs a `RoundPlan` as one target forward and returns a
`RoundResult`.

`launch(plan)` applies releases and set-ups, has the drafter propose for the SPEC requests
(batched), builds one ragged batch in plan order and uploads it (`executor/ragged_batch.py`),
enqueues one target forward over all its rows (K/V written into the paged cache in place) and
the acceptance on the device (`executor/accept.py`), and starts one copy of its results, all
without waiting for the device. `finish(pending)` waits for that copy, walks the accepted
prefixes and commits by advancing each slot's committed length: accepted K/V were written by
the verify pass itself, rejected rows lie past the end. No second pass, no copy. The engine does
the previous round's per-output work in between; `run = finish(launch(plan))`.

Invariant per decoding slot: `num_computed == len(context) - 1` (the last token's KV is written by
the round that feeds it). An AR-only round may run ahead of the host: see `advance`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from executor.accept import (
    AcceptLaunch,
    emitted_logprobs,
    finish_accept,
    launch_accept,
    round_tokens,
)
from executor.drafters.base import DraftBatch, Drafter, DraftRequest
from executor.graphs import DEFAULT_BUCKETS, DecodeGraphs, bucket_for
from executor.hidden_capture import HiddenCapture
from executor.host_buffer import HostBuffer
from executor.kv_cache import KVCache
from executor.model import Model
from executor.pending_round import LaunchTimes, PendingRound
from executor.ragged_batch import (
    DeviceBatch,
    RaggedBatch,
    RoundRequests,
    build_ragged_batch,
    flat_drafts,
    upload_batch,
)
from executor.recurrent_state import RecurrentStates, RoundStates
from executor.round_timing import RoundPeriods, phase_times
from executor.row_sampler import RowSampler
from executor.slot_table import SlotTable
from executor.structured.slot_constraints import DeviceConstraints, SlotConstraints
from scheduler.plan import Emitted, PhaseTimes, ReqPlan, RoundPlan, RoundResult


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
        # A block drafter writes its block past the verified rows (`kv_lookahead` positions).
        lookahead = int(getattr(drafter, "kv_lookahead", 0))
        self.max_blocks_per_seq = -(-(max_model_len + lookahead) // block_size) + 1
        self.kv = KVCache.for_model(target, num_blocks=num_blocks, block_size=block_size)
        # a hybrid target's linear layers keep per-slot recurrent state beside the KV blocks
        self.states = RecurrentStates.for_model(target, max_slots) if target.is_hybrid else None
        self.drafter = drafter
        self.drafter_follows_prefill = drafter_follows_prefill  # asked for (see follow_prefill)
        self.vocab_size = target.config.vocab_size
        self.table = SlotTable(
            max_slots=max_slots,
            max_model_len=max_model_len,
            max_blocks_per_seq=self.max_blocks_per_seq,
            vocab_size=self.vocab_size,
            base_seed=base_seed,
        )
        if drafter is not None and hasattr(drafter, "bind_block_tables"):
            # a model drafter keeps its KV under the same block ids: it reads this table
            drafter.bind_block_tables(self.table.block_tables)
        # The advanced round in flight, and per slot its row there (-1: none).
        self._ahead: PendingRound | None = None
        self._ahead_row = np.full(max_slots, -1, dtype=np.int64)
        self._periods = RoundPeriods()
        self.sampler = RowSampler(target.config.vocab_size, self.device, base_seed, max_slots)
        # grammar matchers and logit biases; the engine installs the grammar compiler
        self.constraints = SlotConstraints(max_slots, self.vocab_size, self.device)
        self.base_seed = base_seed
        self.sync_phases = sync_phases and self.device.type == "cuda"
        self._host = HostBuffer(self.device)
        self.graphs: DecodeGraphs | None = None
        graph_rows = min(max_graph_rows, DEFAULT_BUCKETS[-1])
        # A drafter that reads the target's hidden states gets them from every forward.
        self.capture: HiddenCapture | None = None
        layer_ids = getattr(drafter, "capture_layer_ids", None)
        if layer_ids:
            self.capture = HiddenCapture.allocate(
                layer_ids,
                graph_rows,
                target.config.hidden_size,
                dtype=target.dtype,
                device=self.device,
            )
        if graphs != "off" and self.device.type == "cuda" and self.states is None:
            self.graphs = DecodeGraphs(
                target,
                self.kv.k,
                self.kv.v,
                max_seqs=max_slots,
                max_blocks_per_seq=self.max_blocks_per_seq,
                max_rows=graph_rows,
                capture=self.capture,
            )
            if graphs == "startup":
                for b in DEFAULT_BUCKETS:
                    if b > self.graphs.max_rows:
                        break
                    self.graphs.capture(b, self.graphs.width_for(1))

    # -- slot bookkeeping ---------------------------------------------------------------------
    def apply_setup_release(self, plan: RoundPlan) -> None:
        """Frees the slots `plan` releases and sets up the requests it admits (host state, the
        sampler's penalty tables, the drafter). Every launch starts with it; benchmarks call it
        to place requests in slots without running a round."""
        for slot in plan.release:
            self.table.release(slot)
            if self.states is not None:
                self.states.release(slot)
            self._ahead_row[slot] = -1
            self.sampler.release_slot(slot)
            self.constraints.release_slot(slot)
            if self.drafter is not None:
                self.drafter.release(slot)
        for s in plan.setup:
            context = list(s.context_token_ids)
            self.table.setup(s, context)
            if self.states is not None:
                self.states.setup(s.slot, s.num_cached_tokens)
            self._ahead_row[s.slot] = -1
            prompt_len = len(context) - s.num_output_tokens
            self.sampler.setup_slot(s.slot, context, prompt_len, s.sampling)
            self.constraints.setup_slot(s.slot, s.sampling, context[prompt_len:])
            if self.drafter is not None:
                # A cached prefix (`s.num_cached_tokens`) needs nothing of a drafter: a block
                # drafter's context there was written by the forwards that computed those
                # blocks; a draft model starts the slot at no draft KV and catches up on the
                # whole context, rewriting its own KV of the shared blocks with what the same
                # tokens give (numerically close to what other readers hold: only their draft
                # quality could differ, never a verified token).
                self.drafter.setup(s.slot, context)

    def context(self, slot: int) -> np.ndarray:
        """The slot's committed context (prompt + outputs), a view."""
        return self.table.context(slot)

    def rewind(self, slot: int, context_len: int, num_computed: int | None = None) -> None:
        """Forgets the slot's tokens past `context_len` (committed length `num_computed`,
        default `context_len - 1`): benchmarks re-run one round from the same state with it."""
        self.table.rewind(slot, context_len, num_computed)

    @property
    def follow_prefill(self) -> bool:
        """Whether the drafter may compute prefill chunks' draft KV in their rounds: asked for,
        and the drafter (which a benchmark may swap) can. A round's plan says whether it does
        (`RoundPlan.follow_prefill`)."""
        return self.drafter_follows_prefill and bool(
            getattr(self.drafter, "follows_prefill", False)
        )

    @property
    def advanced_round(self) -> PendingRound | None:
        """The advanced round still in flight (see `advance`), or None."""
        return self._ahead

    # -- one round ----------------------------------------------------------------------------
    def run(self, plan: RoundPlan) -> RoundResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: RoundPlan) -> PendingRound:
        """Applies set-ups and releases, drafts, builds the batch and enqueues the forward and
        the acceptance without waiting for the device."""
        t0 = time.perf_counter()
        start_event = self._record_event()
        self.apply_setup_release(plan)
        if len(plan.decode) + len(plan.prefills) == 0:
            return PendingRound(plan=plan, t0=t0, start_event=start_event)
        requests = RoundRequests.of_plan(plan)
        self.table.check_round(requests)
        self.table.add_blocks(plan)
        t_draft = time.perf_counter()
        proposal = self._propose(plan, requests)
        self._sync()
        t_build = time.perf_counter()
        ahead = self._ahead
        batch = build_ragged_batch(
            plan,
            requests,
            self.table,
            self.block_size,
            proposal,
            self._ahead_row if ahead is not None else None,
        )
        dev = upload_batch(
            self._host,
            batch,
            self.table,
            proposal,
            ahead.tokens_dev if ahead is not None else None,
        )
        if ahead is not None:
            ahead.overlapped = True
        bucket = self._graph_bucket(plan, batch.num_rows)
        self._sync()
        t_forward = time.perf_counter()
        fwd_start = self._record_event()
        logits = self._forward(dev, bucket, self._round_states(plan, batch))  # [L, vocab]
        fwd_events = None if fwd_start is None else (fwd_start, self._record_event())
        # the constrained rows' masks are filled on the host while the device runs the forward
        constraints = self._constraints(plan, batch, proposal)
        self._sync()
        t_accept = time.perf_counter()
        accept = self._launch_accept(batch, dev, proposal, logits, constraints)
        if plan.follow_prefill and self.follow_prefill and plan.prefills:
            # after the target's forward: on a GPU these launches overlap its device time
            self._follow_prefill(plan.prefills)
        end_event = self._record_event()
        return PendingRound(
            plan=plan,
            t0=t0,
            times=LaunchTimes(t_draft, t_build, t_forward, t_accept, time.perf_counter()),
            batch=batch,
            drafts=proposal,
            accept=accept,
            greedy_dev=dev.sampling.greedy,
            bucket=bucket,
            start_event=start_event,
            end_event=end_event,
            fwd_events=fwd_events,
            behind=ahead is not None,
        )

    def _propose(self, plan: RoundPlan, requests: RoundRequests) -> DraftBatch | None:
        """The drafter's proposal for the plan's SPEC requests (None when none speculates)."""
        dec = plan.decode
        spec = np.flatnonzero(dec.num_draft)
        if not len(spec):
            return None
        if self.drafter is None:
            raise RuntimeError("plan has SPEC requests but the executor has no drafter")
        table = self.table
        spec_slots = dec.slots[spec].tolist()
        # Deferred: a drafter working on the device returns before its drafts reach the host;
        # the batch is built meanwhile and the drafts are copied into its rows on the device,
        # so the forward follows the chain without a wait. Penalties count the drafts on the
        # host at launch, so a round with any takes them at once.
        proposal = self.drafter.propose(
            [
                DraftRequest(
                    s,
                    table.context(s),
                    d,
                    temperature=float(table.float_params[0, s]),
                    seed=int(table.seed[s]) if table.coupled[s] else None,
                )
                for s, d in zip(spec_slots, dec.num_draft[spec].tolist())
            ],
            [bool(table.greedy[s]) for s in spec_slots],
            defer=True,
        )
        if proposal.tokens is None and table.penalised[requests.slots].any():
            proposal.resolve()
        return proposal

    def _graph_bucket(self, plan: RoundPlan, num_rows: int) -> int:
        """The row bucket whose graph replays the round's forward, 0: eager. The plan's bucket
        (the cost model's shape) when it fits the captured range, else the executor's own;
        rounds larger than any graph, and rounds with prefill chunks, run eagerly."""
        if self.graphs is None or not plan.is_decode_only:
            return 0
        bucket = plan.row_bucket
        if not num_rows <= bucket <= self.graphs.max_rows:
            bucket = bucket_for(num_rows)
        return bucket if bucket <= self.graphs.max_rows else 0

    def _round_states(self, plan: RoundPlan, batch: RaggedBatch) -> RoundStates | None:
        """A hybrid target's state layout for the round: SPEC groups journal (see `_commit`)."""
        if self.states is None:
            return None
        return self.states.begin_round(
            plan.round_id, batch.requests.slots, batch.group_rows, plan.decode.num_draft
        )

    def _forward(
        self, dev: DeviceBatch, bucket: int, states: RoundStates | None = None
    ) -> torch.Tensor:
        """The one target forward: the logits of the batch's logit rows [L, vocab]. With a
        drafter reading hidden states, the forward captures them and the drafter's context
        write for every row follows it on the stream."""
        capture = self.capture
        num_rows = len(dev.ids)
        if capture is not None and num_rows > capture.max_rows:  # a wide eager forward
            capture = HiddenCapture.allocate(
                capture.layer_ids,
                num_rows,
                self.target.config.hidden_size,
                dtype=self.target.dtype,
                device=self.device,
            )
        if bucket:
            logits = self.graphs.replay(bucket, dev.ids, dev.meta)
        else:
            hidden = self.target.forward(
                dev.ids, dev.meta, self.kv.k, self.kv.v, capture, states=states
            )  # [rows, hidden]
            if dev.logit_rows is not None:
                hidden = hidden[dev.logit_rows]
            logits = self.target.logits(hidden)
        if capture is not None:
            meta = dev.meta
            self.drafter.extend_context(
                capture.rows(num_rows), meta.positions[:num_rows], meta.slot_mapping[:num_rows]
            )
        return logits

    def _constraints(
        self, plan: RoundPlan, batch: RaggedBatch, proposal: DraftBatch | None
    ) -> DeviceConstraints | None:
        """The round's logit bias and grammar masks, uploaded (None when no row has any). A
        grammar's masks follow the drafts, so a deferred proposal is resolved here: its copy
        to the host was enqueued before the forward, which keeps running meanwhile."""
        if not self.constraints.num_active:
            return None
        input_ids = batch.input_ids
        if batch.drafts_pending and self.constraints.grammar[batch.requests.slots].any():
            proposal.resolve()
            input_ids = self._with_drafts(batch, proposal, plan)
        rc = self.constraints.round_constraints(batch, input_ids)
        return None if rc is None else self.constraints.upload(rc)

    def _launch_accept(
        self,
        batch: RaggedBatch,
        dev: DeviceBatch,
        proposal: DraftBatch | None,
        logits: torch.Tensor,  # [L, vocab]
        constraints: DeviceConstraints | None = None,
    ) -> AcceptLaunch:
        """The acceptance of every logit row enqueued on the device, its copy to the host
        started; penalised rows count the drafts before them as output."""
        st = dev.sampling
        draft_probs = proposal.probs if proposal is not None else None
        coupled = None
        if draft_probs is not None and self.table.coupled[batch.row_slot].any():
            coupled = torch.from_numpy(self.table.coupled[batch.row_slot]).to(
                self.device, non_blocking=True
            )  # [L]
        return launch_accept(
            logits,
            st,
            self.sampler,
            batch.row_slot,
            batch.preceding_drafts() if st.use_penalties else None,
            dev.next_draft,
            draft_probs,
            dev.draft_rows,
            coupled,
            constraints,
        )

    def _follow_prefill(self, prefills: tuple[ReqPlan, ...]) -> None:
        """Has the drafter compute the draft KV of this round's prefill chunks. The first chunk
        after a cached prefix goes from position 0: the drafter has no draft KV of the prefix
        (the scheduler counts it followed the same way)."""
        cached = self.table.num_cached
        starts = [0 if q.num_computed == cached[q.slot] else q.num_computed for q in prefills]
        self.drafter.follow_prefill(
            [q.slot for q in prefills],
            starts,
            [
                self.table.tokens[q.slot, a : q.num_computed + q.num_new]
                for q, a in zip(prefills, starts)
            ],
        )

    def _record_event(self) -> torch.cuda.Event | None:
        """A timing event recorded at this point of the stream (None off a GPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _sync(self) -> None:
        if self.sync_phases:
            torch.cuda.synchronize(self.device)

    # -- rounds ahead -------------------------------------------------------------------------
    def can_advance(self, p: PendingRound) -> bool:
        """Whether the next round may be launched before `p` finishes: `p` is AR rows only
        (no drafts, no prefill) whose tokens need nothing of the host (no penalties, whose
        counts are committed on the host, no grammar, whose next masks follow these tokens,
        and no logprobs, read from the logits the next round's graph replay overwrites), and
        no other round is ahead."""
        plan = p.plan
        if self._ahead is not None or p.accept is None or plan.prefills:
            return False
        slots = p.batch.requests.slots
        return (
            len(slots) > 0
            and not plan.decode.num_draft.any()
            and not self.table.penalised[slots].any()
            and not (self.constraints.num_active and self.constraints.grammar[slots].any())
            and bool((self.table.logprobs_k[slots] < 0).all())
        )

    def advance(self, p: PendingRound) -> None:
        """Takes every request of the launched AR round `p` to have computed one more token, so
        the next round can be launched before `p` finishes. That round's rows for those
        requests read their input token straight from `p`'s sampled tokens on the device, so
        the host's work between rounds (finish, the scheduler's update and plan, the batch
        build) overlaps the device's forward instead of leaving it idle. `finish(p)` must still
        come before the next round's finish: rounds finish in launch order."""
        if not self.can_advance(p):
            raise RuntimeError(f"round {p.plan.round_id} cannot be advanced")
        slots = p.batch.requests.slots
        n = len(slots)
        p.tokens_dev = p.accept.tokens_dev(p.greedy_dev, n)
        self.table.num_computed[slots] += 1
        self._ahead = p
        self._ahead_row[slots] = np.arange(n)

    # -- finishing a round --------------------------------------------------------------------
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
        advanced = p.tokens_dev is not None
        if self._ahead is not None and not advanced:
            raise RuntimeError("rounds finish in launch order: the advanced round comes first")
        if advanced:  # its one token per request was counted by advance()
            self._ahead = None
            self._ahead_row.fill(-1)
        t_wait = time.perf_counter()
        host = finish_accept(p.accept)  # the one wait for the device
        input_ids = self._input_ids_with_drafts(p)
        t_commit = time.perf_counter()
        out = self._commit(p, host, input_ids, advanced)
        t_end = time.perf_counter()
        timings = phase_times(p, t_wait, t_commit, t_end, self._periods.period_ms(p, t_end))
        self._periods.finished(p, t_end)
        batch = p.batch
        return RoundResult(
            round_id=plan.round_id,
            out=out,
            timings=timings,
            num_rows=batch.num_rows,
            num_padded_rows=p.bucket or batch.num_rows,
            num_kv_tokens=int(batch.seq_lens.sum()),
            graph_replayed=bool(p.bucket),
            overlapped=p.overlapped,
        )

    def _input_ids_with_drafts(self, p: PendingRound) -> np.ndarray:
        """The round's input ids [R] with the drafts in place, once a deferred proposal (whose
        copy came before the acceptance's) is resolved."""
        batch = p.batch
        if p.drafts is None:
            return batch.input_ids
        p.drafts.resolve()
        return self._with_drafts(batch, p.drafts, p.plan)

    @staticmethod
    def _with_drafts(batch: RaggedBatch, proposal: DraftBatch, plan: RoundPlan) -> np.ndarray:
        """[R] the batch's input ids with a resolved proposal's drafts at their rows."""
        if not batch.drafts_pending:
            return batch.input_ids
        input_ids = batch.input_ids.copy()
        input_ids[batch.draft_in_rows] = flat_drafts(proposal, plan)
        return input_ids

    def _commit(self, p: PendingRound, host: np.ndarray, input_ids: np.ndarray, advanced: bool):
        """Emitted tokens from the acceptance's results, committed for the slots the round's
        requests still hold: committed lengths, contexts, penalty counts, drafter state."""
        batch, dec = p.batch, p.plan.decode
        requests = batch.requests
        slots, n = requests.slots, requests.num_decode
        table = self.table
        forced = None
        if p.drafts is not None and p.drafts.forced_accept is not None:
            forced = np.zeros(n, dtype=np.int64)
            forced[np.flatnonzero(dec.num_draft)] = p.drafts.forced_accept
        emitted = round_tokens(
            host,
            input_ids,
            batch.group_rows,
            dec.num_draft,
            table.greedy[slots],
            p.accept.has_rejection,
            forced,
            batch.sample_of,
        )
        num_grown = None  # an advanced round's one row per request was counted by advance()
        if not advanced:  # a decode group keeps its accepted drafts' KV, a chunk all of its own
            is_dec = np.arange(len(slots)) < n
            num_grown = np.where(is_dec, 1 + emitted.num_accepted, np.diff(batch.group_rows))
        own = table.commit(requests, emitted, num_grown)
        if self.states is not None:  # a SPEC group's state after its last accepted row
            self.states.commit(p.plan.round_id, own, emitted.num_accepted)
        starts, tokens = emitted.starts, emitted.tokens
        for i in np.flatnonzero(table.penalised[slots] & own & (emitted.num_emitted > 0)).tolist():
            self.sampler.commit(int(slots[i]), tokens[starts[i] : starts[i + 1]].tolist())
        if self.constraints.num_active:  # matchers consume what their requests committed
            grammar = self.constraints.grammar[slots] & own & (emitted.num_emitted > 0)
            for i in np.flatnonzero(grammar).tolist():
                self.constraints.commit(int(slots[i]), tokens[starts[i] : starts[i + 1]].tolist())
        if self.drafter is not None:
            # drafters only hear about rounds in which they drafted: AR and prefill tokens
            # reach them through the context at their next proposal
            for i in np.flatnonzero((dec.num_draft > 0) & own[:n]).tolist():
                s = int(slots[i])
                self.drafter.commit(
                    s, table.context(s), int(emitted.num_accepted[i]), int(dec.num_draft[i])
                )
        logprobs = emitted_logprobs(
            p.accept.logits,
            emitted,
            table.logprobs_k[slots],
            batch.group_rows,
            n,
            batch.sample_of,
        )
        drafted = np.zeros(len(slots), dtype=np.int64)
        drafted[:n] = dec.num_draft
        return Emitted.build(
            requests.req_ids, emitted.num_emitted, tokens, drafted, emitted.num_accepted, logprobs
        )
