"""The one-pass round executor: runs a `RoundPlan` as one target forward and returns a
`RoundResult`.

Per round:
1. apply releases and set-ups (per-slot host state, drafter state);
2. drafters propose tokens for the SPEC requests (batched);
3. build one ragged batch in plan order: PREFILL chunks, AR rows (the last committed token),
   SPEC groups (last committed token + drafts), padded to the plan's row bucket;
4. one target forward over all rows; K/V written into the paged cache in place;
5. accept on the device (greedy match or exact rejection sampling); only counts and tokens go
   to the host;
6. commit by advancing each slot's committed length: accepted K/V were written by the verify pass
   itself, rejected rows lie past the end. No second pass, no copy.

Invariant per decoding slot: `num_computed == len(context) - 1` (the last token's KV is written by
the round that feeds it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from executor.accept import AcceptInputs, accept_batch
from executor.drafters.base import DraftBatch, Drafter, DraftRequest
from executor.graphs import DEFAULT_BUCKETS, DecodeGraphs, bucket_for
from executor.kv_cache import KVCache
from executor.model import AttnMetadata, Model
from executor.row_sampler import RowSampler
from scheduler.plan import (
    Mode,
    PhaseTimes,
    ReqResult,
    RoundPlan,
    RoundResult,
    SamplingSpec,
)


@dataclass
class SlotState:
    req_id: int
    context: list[int]  # prompt + committed outputs
    sampling: SamplingSpec
    prompt_len: int
    num_computed: int = 0
    num_emitted: int = 0  # tokens emitted since set-up started (RNG step key)
    block_ids: list[int] = field(default_factory=list)


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
        self.slots: dict[int, SlotState] = {}
        # Host mirror of each slot's block table; the rows a round touches are uploaded at once.
        self.block_tables = np.zeros((max_slots, self.max_blocks_per_seq), dtype=np.int32)
        if drafter is not None and hasattr(drafter, "bind_block_tables"):
            # a model drafter keeps its KV under the same block ids: it reads this table
            drafter.bind_block_tables(self.block_tables)
        self.sampler = RowSampler(target.config.vocab_size, self.device, base_seed, max_slots)
        self.sync_phases = sync_phases and self.device.type == "cuda"
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
            self.slots.pop(slot, None)
            self.sampler.release_slot(slot)
            if self.drafter is not None:
                self.drafter.release(slot)
        for s in plan.setup:
            context = list(s.context_token_ids)
            self.slots[s.slot] = SlotState(
                req_id=s.req_id,
                context=context,
                sampling=s.sampling,
                prompt_len=len(context) - s.num_output_tokens,
                num_emitted=s.num_output_tokens,
            )
            self.sampler.setup_slot(s.slot, context, len(context) - s.num_output_tokens, s.sampling)
            if self.drafter is not None:
                self.drafter.setup(s.slot, context)

    def _sync(self) -> None:
        if self.sync_phases:
            torch.cuda.synchronize(self.device)

    # -- one round ----------------------------------------------------------------------------
    def run(self, plan: RoundPlan) -> RoundResult:
        t0 = time.perf_counter()
        self._apply_setup_release(plan)
        reqs = plan.reqs
        if not reqs:
            return RoundResult(
                round_id=plan.round_id,
                reqs=(),
                timings=PhaseTimes(),
                num_rows=0,
                num_padded_rows=0,
                num_kv_tokens=0,
            )
        for r in reqs:
            st = self.slots[r.slot]
            if st.req_id != r.req_id or st.num_computed != r.num_computed:
                raise RuntimeError(
                    f"plan/executor state mismatch for req {r.req_id} in slot {r.slot}: "
                    f"executor has req {st.req_id} at {st.num_computed} tokens, plan says "
                    f"{r.num_computed}"
                )
            if r.new_block_ids:
                end = r.block_offset + len(r.new_block_ids)
                self.block_tables[r.slot, r.block_offset : end] = r.new_block_ids

        # 2. drafts
        t_draft0 = time.perf_counter()
        spec = [r for r in reqs if r.mode == Mode.SPEC]
        drafts: DraftBatch | None = None
        if spec:
            if self.drafter is None:
                raise RuntimeError("plan has SPEC requests but the executor has no drafter")
            drafts = self.drafter.propose(
                [
                    DraftRequest(
                        r.slot,
                        self.slots[r.slot].context,
                        r.num_draft,
                        temperature=self.slots[r.slot].sampling.temperature,
                    )
                    for r in spec
                ],
                [self.slots[r.slot].sampling.greedy for r in spec],
            )
        self._sync()
        t_build0 = time.perf_counter()

        # 3. the ragged batch, in plan order
        input_ids: list[int] = []
        positions: list[int] = []
        cu_q_lens = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []  # rows whose logits are needed
        draft_of: dict[int, list[int]] = {}
        spec_idx = 0
        for r in reqs:
            st = self.slots[r.slot]
            start = r.num_computed
            if r.mode == Mode.PREFILL:
                tokens = st.context[start : start + r.num_new]
            elif r.mode == Mode.AR:
                tokens = [st.context[-1]]
            else:
                assert drafts is not None
                draft_tokens = drafts.tokens[spec_idx]
                spec_idx += 1
                draft_of[r.req_id] = draft_tokens
                tokens = [st.context[-1], *draft_tokens]
            if len(tokens) != r.num_new:
                raise RuntimeError(
                    f"req {r.req_id}: plan has {r.num_new} rows, built {len(tokens)}"
                )
            row0 = len(input_ids)
            input_ids += tokens
            positions += range(start, start + r.num_new)
            cu_q_lens.append(len(input_ids))
            seq_lens.append(start + r.num_new)
            if r.mode == Mode.PREFILL:
                if r.sample:
                    logit_rows.append(row0 + r.num_new - 1)
            else:
                logit_rows += range(row0, row0 + r.num_new)
        num_rows = len(input_ids)
        dev = self.device
        pos_np = np.asarray(positions, dtype=np.int64)
        slot_rows = np.repeat(np.asarray([r.slot for r in reqs]), np.diff(cu_q_lens))
        block_ids = self.block_tables[slot_rows, pos_np // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + pos_np % self.block_size
        max_blocks = -(-max(seq_lens) // self.block_size)
        meta = AttnMetadata(
            positions=torch.from_numpy(pos_np).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            cu_q_lens=torch.tensor(cu_q_lens, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(
                self.block_tables[[r.slot for r in reqs], :max_blocks]
            ).to(dev, non_blocking=True),
            max_q_len=max(r.num_new for r in reqs),
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
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
        t_fwd0 = time.perf_counter()
        if self.device.type == "cuda":
            fwd_events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            fwd_events[0].record()

        # 4. one target forward (graph replay for decode rounds)
        if bucket:
            logits = self.graphs.run(
                bucket,
                ids_t,
                meta.positions,
                meta.slot_mapping,
                meta.cu_q_lens,
                meta.seq_lens,
                meta.block_tables,
                max_q_len=meta.max_q_len,
            )
        else:
            hidden = self.target.forward(ids_t, meta, self.kv.k, self.kv.v)  # [rows, hidden]
            if len(logit_rows) < num_rows:
                hidden = hidden[torch.tensor(logit_rows, dtype=torch.int64, device=dev)]
            logits = self.target.logits(hidden)  # [num_logit_rows, vocab]
        num_padded = bucket or num_rows
        if self.device.type == "cuda":
            fwd_events[1].record()
        # Without a sync here the host prepares acceptance (sampling tensors, row bookkeeping)
        # while the device still runs the forward; the accept's copy to host is the one wait.
        self._sync()
        t_acc0 = time.perf_counter()

        # 5. accept on device, counts and tokens to host
        accepted = accept_batch(
            AcceptInputs(
                logits=logits,
                reqs=reqs,
                slots=self.slots,
                drafts=draft_of,
                draft_probs=drafts.probs if drafts is not None else None,
                forced_accept=drafts.forced_accept if drafts is not None else None,
            ),
            self.sampler,
        )
        t_commit0 = time.perf_counter()

        # 6. commit
        results = []
        for r, acc in zip(reqs, accepted):
            st = self.slots[r.slot]
            if r.mode == Mode.PREFILL:
                st.num_computed += r.num_new
            elif r.mode == Mode.AR:
                st.num_computed += 1
            else:
                # the last committed token and the accepted drafts now have valid KV
                st.num_computed += 1 + acc.num_accepted
            st.context += acc.token_ids
            self.sampler.commit(r.slot, acc.token_ids)
            st.num_emitted += len(acc.token_ids)
            if self.drafter is not None and acc.token_ids:
                self.drafter.commit(r.slot, st.context, acc.num_accepted, r.num_draft)
            results.append(
                ReqResult(
                    req_id=r.req_id,
                    token_ids=tuple(acc.token_ids),
                    num_drafted=r.num_draft if r.mode == Mode.SPEC else 0,
                    num_accepted=acc.num_accepted,
                    logprobs=acc.logprobs,
                )
            )
        t_end = time.perf_counter()
        ms = 1e3
        timings = PhaseTimes(
            build_ms=(t_fwd0 - t_build0 + t_draft0 - t0) * ms,
            draft_ms=(t_build0 - t_draft0) * ms,
            catchup_ms=drafts.catchup_ms if drafts is not None else 0.0,
            # device time of the forward where events exist (host time otherwise)
            forward_ms=(
                fwd_events[0].elapsed_time(fwd_events[1])
                if self.device.type == "cuda"
                else (t_acc0 - t_fwd0) * ms
            ),
            accept_ms=(t_commit0 - t_acc0) * ms,
            commit_ms=(t_end - t_commit0) * ms,
            total_ms=(t_end - t0) * ms,
        )
        return RoundResult(
            round_id=plan.round_id,
            reqs=tuple(results),
            timings=timings,
            num_rows=num_rows,
            num_padded_rows=num_padded,
            num_kv_tokens=sum(seq_lens),
            graph_replayed=bool(bucket),
        )
