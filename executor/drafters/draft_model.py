"""Draft-model drafting: a small model with the target's tokenizer proposes a chain of tokens.

One round of drafting for all speculating requests together:

    step 0   one ragged forward: per request the context tokens the drafter has no KV for yet
             (catch-up after AR rounds or a prefill, at least the last committed token); the last
             row of each request yields draft x_1;
    step j   one forward of one row per request that still drafts: x_j at its position, yielding
             x_{j+1} (j = 1 .. num_draft - 1).

The drafter keeps its own paged KV cache under the *target's* block ids (`DraftModelDrafter`
says why that is safe). On a GPU every step replays a captured graph (`executor/graphs.py`):
eagerly, a small model's step is bound by its kernel launches, not by the device. Wide forwards
(a prefill chunk the drafter follows, a long catch-up) replay a second graph set that returns
hidden states (`WIDE_BUCKETS`); the picked rows' logits are computed after the replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor.device_clock import DeviceClock
from executor.drafters.base import DraftBatch, DraftRequest
from executor.drafters.draft_chain import ChainPlan, drafts_resolver, plan_chain
from executor.drafters.draft_pick import DrawKeys, pick_drafts
from executor.graphs import DEFAULT_BUCKETS, DecodeGraphs, bucket_for
from executor.kv_cache import KVCache
from executor.model import AttnMetadata, Model

# Rows per request of one step-0 graph replay: the last committed token, the last accepted draft
# whose KV a fully accepted chain lacks, and a short catch-up; longer catch-ups take passes.
GRAPH_MAX_ROWS_PER_SEQ = 4
# A longer catch-up runs through the step-0 graphs in passes of GRAPH_MAX_ROWS_PER_SEQ rows per
# request; beyond this many passes one eager forward is cheaper than replaying them all.
MAX_CATCHUP_PASSES = 8
# With wide graphs, a catch-up needing more step-0 passes than this is one wide replay instead
# (a pass replays the whole draft model with logits for every row).
WIDE_MAX_PASSES = 1
# Row buckets of the wide (hidden-state) graphs, a wide forward of more rows runs eagerly; steps
# of 256 near the top, where a whole prompt's catch-up lands, so a pass pads little.
WIDE_BUCKETS = (32, 64, 128, 192, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
# Rows per sequence the wide graphs' attention tiles are planned for (any mix runs correctly).
WIDE_ROWS_HINT = 64


def wide_passes(lens: Sequence[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """Rows of sequences with `lens` rows each, in order, cut into passes of at most `cap` rows:
    per pass its pieces (sequence, first row, rows). A sequence goes on in the next pass where
    one is full, so all passes but the last hold `cap` rows."""
    passes: list[list[tuple[int, int, int]]] = [[]]
    room = cap
    for k, n in enumerate(lens):
        start = 0
        while start < n:
            if room == 0:
                passes.append([])
                room = cap
            take = min(n - start, room)
            passes[-1].append((k, start, take))
            start += take
            room -= take
    return passes if passes[0] else []


class DraftModelDrafter:
    """Drafts with `model`; its KV lives in a cache of its own indexed by the target's block
    ids. Every position the drafter writes in a round (the catch-up positions, then
    `len(context) - 1 + j` for j < num_draft) lies below `num_computed + 1 + num_draft`, which
    the scheduler has already allocated blocks for, and the valid draft KV after the round (see
    `commit`) never reaches past the target's committed length, whose blocks the scheduler
    keeps. So no second allocator is needed; the cache only doubles the bytes per block
    (`KVCache.blocks_for_budget` counts both models). The draft model must share the target's
    vocabulary: draft distributions are indexed by token id.

    Step-0 passes take at most `GRAPH_MAX_ROWS_PER_SEQ` rows per request, so a catch-up of a few
    AR rounds' tokens stays graphed; chain steps replay one graph each (capturing the whole
    chain as one graph is no faster)."""

    name = "draft-model"
    has_probs = True

    def __init__(
        self,
        model: Model,
        *,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        max_model_len: int,
        seed: int = 0,
        graphs: str = "lazy",
        catchup_rows_per_pass: int | None = None,
    ):
        if graphs not in ("lazy", "startup", "off"):
            raise ValueError(f"graphs must be lazy, startup or off, got {graphs!r}")
        self.model = model
        self.max_slots = max_slots
        self.use_graphs = graphs != "off" and model.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None  # made when the block table is bound
        self.wide_graphs: DecodeGraphs | None = None  # hidden states of wide forwards
        # Step 0 rows per request per forward (None: all in one); passes only pay with graphs.
        self.catchup_rows_per_pass = catchup_rows_per_pass or (
            GRAPH_MAX_ROWS_PER_SEQ if self.use_graphs else None
        )
        # Step-0 passes at most; a longer catch-up is one wide forward (graphed: one pass)
        self.max_catchup_passes = WIDE_MAX_PASSES if self.use_graphs else MAX_CATCHUP_PASSES
        # rows of one wide pass (`_wide_rows`), and the row buckets a graphed pass pads to
        self.wide_pass_rows = WIDE_BUCKETS[-1]
        self.wide_buckets = WIDE_BUCKETS if self.use_graphs else ()
        self.device = model.device
        self.block_size = block_size
        # drafting writes positions below this (the draft model's rope table may be shorter)
        self.max_position = min(max_model_len, model.max_position)
        self.kv = KVCache.for_model(model, num_blocks=num_blocks, block_size=block_size)
        # Per slot: positions [0, kv_len) hold valid draft KV for the slot's committed context.
        self.kv_len = np.zeros(max_slots, dtype=np.int64)  # [max_slots]
        # The executor's host block table [max_slots, max_blocks_per_seq] int32, shared by
        # reference: the executor writes a round's new block ids before it asks for drafts.
        self.block_tables: np.ndarray | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._draw_keys: DrawKeys | None = None  # the proposal in progress's coupled requests

    def bind_block_tables(self, block_tables: np.ndarray) -> None:
        """Called once by the executor with its block table; the drafter only reads it."""
        self.block_tables = block_tables
        if self.use_graphs:

            def graph_set(max_rows: int, logits: bool) -> DecodeGraphs:
                return DecodeGraphs(
                    self.model,
                    self.kv.k,
                    self.kv.v,
                    max_seqs=self.max_slots,
                    max_blocks_per_seq=block_tables.shape[1],
                    max_rows=max_rows,
                    logits=logits,
                )

            chain_rows = bucket_for(GRAPH_MAX_ROWS_PER_SEQ * self.max_slots) or DEFAULT_BUCKETS[-1]
            self.graphs = graph_set(chain_rows, logits=True)
            self.wide_graphs = graph_set(WIDE_BUCKETS[-1], logits=False)

    def capture_graphs(
        self,
        max_seqs: int | None = None,
        widths: tuple[int, ...] = (),
        q_lens=(1, 2, 4),
        max_wide_rows: int = 0,
    ) -> int:
        """Captures the drafting graphs ahead of serving: every row bucket that `max_seqs`
        requests with `q` rows each can need (q = 1: chain steps; q = 2: step 0 after a fully
        accepted chain; q = 4: step 0 passes of a catch-up), at the given block-table widths in
        blocks (default: the narrowest), and the wide graphs of up to `max_wide_rows` rows.
        Returns how many graphs exist. Without graphs (CPU, or off) nothing happens."""
        if self.graphs is None:
            return 0
        top = min(max_seqs or self.max_slots, self.max_slots)
        widths = tuple(sorted({self.graphs.width_for(w) for w in widths or (1,)}))
        if self.wide_graphs is not None and max_wide_rows > 0:
            for bucket in WIDE_BUCKETS:
                for width in widths:
                    self.wide_graphs.capture(bucket, width, WIDE_ROWS_HINT)
                if bucket >= max_wide_rows:
                    break
        for q in q_lens:
            for bucket in DEFAULT_BUCKETS:
                if q > bucket or bucket > self.graphs.max_rows:
                    continue
                for width in widths:
                    self.graphs.capture(bucket, width, q)
                if bucket >= top * q:
                    break
        return self.num_graphs

    @property
    def num_graphs(self) -> int:
        """Captured graphs, wide ones included (0 without graphs)."""
        return sum(len(g.graphs) for g in (self.graphs, self.wide_graphs) if g is not None)

    # -- slot lifecycle -----------------------------------------------------------------------
    def setup(self, slot: int, context: list[int]) -> None:
        self.kv_len[slot] = 0  # nothing drafted yet: the first SPEC round catches up

    def release(self, slot: int) -> None:
        self.kv_len[slot] = 0

    def commit(self, slot: int, context: list[int], num_accepted: int, num_draft: int) -> None:
        """After a SPEC round that started from L = len(context) - num_accepted - 1 committed
        tokens, the draft KV is valid through the accepted drafts: positions below
        L + min(num_accepted, num_draft - 1) (the last draft was never fed, so a fully accepted
        chain lacks its KV). After AR and prefill rounds the drafter lags and catches up later."""
        prev_len = len(context) - num_accepted - 1
        if num_draft > 0 and self.kv_len[slot] == prev_len:
            # `propose` drafted from exactly this context: the chain's KV of x_1 .. x_{d-1}
            # sits at positions prev_len .. prev_len + d - 2
            self.kv_len[slot] = prev_len + min(num_accepted, num_draft - 1)
        else:
            self.kv_len[slot] = min(int(self.kv_len[slot]), prev_len)

    follows_prefill = True  # follow_prefill computes prefill chunks' draft KV

    def follow_prefill(
        self, slots: list[int], starts: list[int], chunks: list[Sequence[int]]
    ) -> int:
        """Computes the draft KV of prefill chunks in the round that prefills them: chunk k holds
        the tokens of `slots[k]` at positions starts[k] .. starts[k] + len(chunks[k]) - 1. One
        eager ragged forward, no logits. Only chunks that continue the draft KV exactly
        (kv_len == start) are taken; the others catch up at their first speculating round as
        before. Returns the rows computed.

        Why: the first speculating round of a request otherwise catches the drafter up on its
        whole prompt in one eager forward of its own, bound by the host (its launches take many
        times its device work). Issued after the target's eager prefill forward of the same
        round, the launches overlap that forward's device time instead."""
        if self.block_tables is None:
            raise RuntimeError("DraftModelDrafter needs the executor's block table (bind it)")
        keep = [
            k
            for k, (slot, start, chunk) in enumerate(zip(slots, starts, chunks))
            if len(chunk)
            and int(self.kv_len[slot]) == start
            and start + len(chunk) <= self.max_position
        ]
        if not keep:
            return 0
        k_slots = [int(slots[k]) for k in keep]
        k_starts = [int(starts[k]) for k in keep]
        self._wide_rows(k_slots, k_starts, [chunks[k] for k in keep], last_hidden=False)
        rows = 0
        for slot, start, k in zip(k_slots, k_starts, keep):
            self.kv_len[slot] = start + len(chunks[k])
            rows += len(chunks[k])
        return rows

    # -- drafting -----------------------------------------------------------------------------
    def propose(
        self, requests: list[DraftRequest], greedy: list[bool], defer: bool = False
    ) -> DraftBatch:
        if self.block_tables is None:
            raise RuntimeError("DraftModelDrafter needs the executor's block table (bind it)")
        clock = DeviceClock(self.device)  # start, after step 0, end of the chain
        num_reqs = len(requests)
        num_drafts = np.array([r.num_draft for r in requests], dtype=np.int64)  # [num_reqs]
        max_draft = int(num_drafts.max(initial=0))
        if max_draft == 0:
            return DraftBatch(tokens=[[] for _ in requests])
        vocab = self.model.config.vocab_size
        dev = self.device
        temps = np.array(
            [0.0 if g else max(r.temperature, 1e-5) for r, g in zip(requests, greedy)],
            dtype=np.float32,
        )  # [num_reqs], 0 for greedy
        draft_offsets = np.concatenate([[0], np.cumsum(num_drafts)]).astype(np.int64)
        probs = None  # [sum(num_draft), vocab], only when some request samples
        if temps.any():
            probs = torch.zeros(int(draft_offsets[-1]), vocab, dtype=torch.float32, device=dev)
        draft_tokens = torch.zeros(num_reqs, max_draft, dtype=torch.int64, device=dev)
        self._draw_keys = DrawKeys.of_requests(requests, dev) if temps.any() else None
        chain = plan_chain(
            requests,
            num_drafts,
            temps,
            draft_offsets,
            block_tables=self.block_tables,
            block_size=self.block_size,
            max_position=self.max_position,
            device=dev,
        )

        # step 0: catch-up rows and the last committed token
        num_catchup_rows = self._step0(requests, chain, draft_tokens, probs)
        clock.mark()
        for slot, ctx_len in zip(chain.slots.tolist(), chain.ctx_lens.tolist()):
            # the whole context now has draft KV; the drafts' KV becomes valid in `commit`
            self.kv_len[slot] = ctx_len

        self._chain_steps(max_draft, chain, draft_tokens, probs)

        clock.mark()
        tokens_dev = draft_tokens.view(-1).index_select(0, chain.flat_index)  # [E] request order
        resolve = drafts_resolver(
            tokens_dev, clock, num_catchup_rows, max_draft, len(chain.active), draft_offsets
        )
        batch = DraftBatch(tokens=None, probs=probs, tokens_dev=tokens_dev, resolver=resolve)
        if not defer:
            batch.resolve()
        return batch

    def _step0(
        self,
        requests: list[DraftRequest],
        chain: ChainPlan,
        draft_tokens: torch.Tensor,  # [num_reqs, max_draft] out
        probs: torch.Tensor | None,  # [sum(num_draft), vocab] out
    ) -> int:
        """Step 0: per request the context rows the drafter has no KV for (at least the last
        committed token), the last row's logits picking draft x_1. One ragged forward, or with
        graphs passes of `catchup_rows_per_pass` rows per request (a request leaves the passes
        at the one holding its last row). Returns the number of catch-up rows."""
        active, slots = chain.active, chain.slots
        first_pos, num_rows = [], []
        for i, ctx_len in zip(active.tolist(), chain.ctx_lens.tolist()):
            start = min(int(self.kv_len[requests[i].slot]), ctx_len - 1)
            first_pos.append(start)
            num_rows.append(ctx_len - start)
        per_pass = self.catchup_rows_per_pass or max(num_rows)
        num_passes = -(-max(num_rows) // per_pass)
        req, _, _, prow, temp = chain.entries(0)
        dev = self.device
        if num_passes > self.max_catchup_passes:
            if self.wide_graphs is not None:  # one wide pass, graphed
                hidden = self._wide_rows(
                    slots.tolist(),
                    first_pos,
                    [
                        requests[i].context[a : a + n]
                        for i, a, n in zip(active.tolist(), first_pos, num_rows)
                    ],
                    last_hidden=True,
                )  # [n0, hidden]
                logits = self.model.logits(hidden)
                self._pick(logits, req, prow, temp, 0, draft_tokens, probs)
                return sum(num_rows) - len(num_rows)
            per_pass, num_passes = max(num_rows), 1
        rows_np = np.asarray(num_rows, dtype=np.int64)  # [n0]
        for p in range(num_passes):
            lo = p * per_pass
            members = np.flatnonzero(rows_np > lo)  # [m] requests with rows left
            pass_rows = np.minimum(rows_np[members] - lo, per_pass)  # [m]
            input_ids = []
            for k, rows in zip(members.tolist(), pass_rows.tolist()):
                start = first_pos[k] + lo
                input_ids += np.asarray(
                    requests[int(active[k])].context[start : start + rows]
                ).tolist()
            finishing = rows_np[members] <= lo + per_pass  # [m] last row in this pass
            last_rows = (np.cumsum(pass_rows) - 1)[finishing]  # [f]
            meta = self._meta(
                slots[members].tolist(),
                [first_pos[k] + lo for k in members.tolist()],
                pass_rows.tolist(),
            )
            ids_t = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
            logits = self._forward_logits(
                ids_t, meta, int(pass_rows.max()), torch.from_numpy(last_rows).to(dev)
            )
            if num_passes == 1:
                self._pick(logits, req, prow, temp, 0, draft_tokens, probs)
            elif finishing.any():  # (a pass where no request ends only writes KV)
                done = torch.from_numpy(members[finishing]).to(dev)  # [f] positions in active
                self._pick(logits, req[done], prow[done], temp[done], 0, draft_tokens, probs)
        return int(rows_np.sum()) - len(num_rows)

    def _chain_steps(
        self,
        max_draft: int,
        chain: ChainPlan,
        draft_tokens: torch.Tensor,  # [num_reqs, max_draft] in and out
        probs: torch.Tensor | None,  # [sum(num_draft), vocab] out
    ) -> None:
        """Steps 1 .. max_draft-1 one forward each: one row per request still drafting, its
        metadata computed on the device."""
        dev = self.device
        bs = self.block_size
        arange = torch.arange(len(chain.steps[0]) + 1, dtype=torch.int32, device=dev)
        for j in range(1, max_draft):
            req, row, last_pos, prow, temp = chain.entries(j)
            n = len(chain.steps[j])
            positions = last_pos + j  # [n]
            tables = chain.tables[row]  # [n, width]
            block = tables.gather(1, (positions // bs)[:, None]).squeeze(1).long()
            meta = AttnMetadata(
                positions=positions,
                slot_mapping=block * bs + positions % bs,
                cu_q_lens=arange[: n + 1],
                seq_lens=(positions + 1).to(torch.int32),
                block_tables=tables,
                max_q_len=1,
            )
            logits = self._forward_logits(draft_tokens[req, j - 1], meta, 1, None)
            self._pick(logits, req, prow, temp, j, draft_tokens, probs)

    def _forward_logits(
        self,
        ids: torch.Tensor,  # [num_rows] int64 on the device
        meta: AttnMetadata,  # on the device
        max_q_len: int,  # most rows of one sequence
        pick_rows: torch.Tensor | None,  # [num_seqs] rows whose logits are wanted; None: all
    ) -> torch.Tensor | None:
        """Forward of the rows `meta` describes, K/V written into the draft cache; float32
        logits of the picked rows [num_picked, vocab] (None when none is picked). A graph
        replays it when one fits."""
        bucket = bucket_for(len(ids))
        if (
            self.graphs is not None
            and 0 < bucket <= self.graphs.max_rows
            and max_q_len <= GRAPH_MAX_ROWS_PER_SEQ
        ):
            # [num_rows, vocab], a view of the graph's output: read before the next replay
            logits = self.graphs.replay(bucket, ids, meta, max_q_len)
        else:
            logits = None
            hidden = self._wide_forward(ids, meta)
        if pick_rows is not None and len(pick_rows) == 0:
            return None
        if logits is None:
            return self.model.logits(hidden if pick_rows is None else hidden[pick_rows])
        return logits if pick_rows is None else logits[pick_rows]

    def _wide_rows(
        self,
        slots: list[int],
        first_pos: list[int],
        tokens: list[Sequence[int]],  # per sequence its rows' tokens from first_pos on (>= 1)
        last_hidden: bool,
    ) -> torch.Tensor | None:
        """Forwards every sequence's rows, K/V written into the draft cache, in passes of at
        most `wide_pass_rows` rows that the wide graphs take: the rows in sequence order, a
        sequence cut where a pass is full and continued in the next (its later rows attend to
        the KV the earlier pass wrote), so every pass but the last is full and only the last pads
        to its bucket. Returns the hidden states of each sequence's last row [num_seqs, hidden]
        (last_hidden), else None."""
        last = []
        for pieces in wide_passes([len(t) for t in tokens], self.wide_pass_rows):
            lens = [n for _, _, n in pieces]
            ids = np.concatenate(
                [np.asarray(tokens[k][a : a + n], dtype=np.int64) for k, a, n in pieces]
            )
            meta = self._meta(
                [slots[k] for k, _, _ in pieces], [first_pos[k] + a for k, a, _ in pieces], lens
            )
            ids_t = torch.from_numpy(ids).to(self.device, non_blocking=True)  # [rows]
            hidden = self._wide_forward(ids_t, meta)  # [rows, hidden]
            ends = np.cumsum(lens) - 1  # [pieces] each piece's last row
            done = [a + n == len(tokens[k]) for k, a, n in pieces]  # the sequence's last piece
            if last_hidden and any(done):  # (a gather: a copy taken before the next replay)
                rows = torch.from_numpy(ends[done]).to(self.device, non_blocking=True)
                last.append(hidden[rows])
        if not last_hidden:
            return None
        return last[0] if len(last) == 1 else torch.cat(last)

    def _wide_forward(self, ids: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """Final-normed hidden states [num_rows, hidden] of the rows `meta` describes, K/V
        written into the draft cache: a wide graph's replay when one fits (its output is a view
        to read before the next replay), else one eager forward."""
        bucket = bucket_for(len(ids), WIDE_BUCKETS)
        if self.wide_graphs is None or bucket == 0:
            return self.model.forward(ids, meta, self.kv.k, self.kv.v)
        return self.wide_graphs.replay(bucket, ids, meta, WIDE_ROWS_HINT)

    def _meta(self, slots: list[int], first_pos: list[int], num_rows: list[int]) -> AttnMetadata:
        """Attention metadata of `num_rows[s]` rows per sequence from position `first_pos[s]`."""
        assert self.block_tables is not None
        bs = self.block_size
        rows_slot = np.repeat(np.asarray(slots, dtype=np.int64), num_rows)  # [num_rows]
        pos_np = np.concatenate(
            [np.arange(p, p + n, dtype=np.int64) for p, n in zip(first_pos, num_rows)]
        )  # [num_rows]
        block_ids = self.block_tables[rows_slot, pos_np // bs].astype(np.int64)
        slot_mapping = block_ids * bs + pos_np % bs  # [num_rows]
        seq_lens = [p + n for p, n in zip(first_pos, num_rows)]
        max_blocks = -(-max(seq_lens) // bs)
        dev = self.device
        return AttnMetadata(
            positions=torch.from_numpy(pos_np).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            cu_q_lens=torch.tensor(
                np.concatenate([[0], np.cumsum(num_rows)]), dtype=torch.int32
            ).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(
                np.ascontiguousarray(self.block_tables[slots, :max_blocks])
            ).to(dev, non_blocking=True),
            max_q_len=max(num_rows),
        )

    def _pick(
        self,
        logits: torch.Tensor,  # [n, vocab] float32, the rows that predict draft j
        req: torch.Tensor,  # [n] request index of each row (device)
        prow: torch.Tensor,  # [n] first probs row of each row's request (device)
        temp: torch.Tensor,  # [n] temperature, 0 for greedy (device)
        j: int,
        draft_tokens: torch.Tensor,  # [num_reqs, max_draft] out
        probs: torch.Tensor | None,  # [sum(num_draft), vocab] out
    ) -> None:
        """Draft j of every row, on the device (`pick_drafts`); sampled rows' q goes to
        `probs`, greedy rows there hold the point mass of their argmax."""
        keys = {} if self._draw_keys is None else self._draw_keys.rows(req, j)
        tokens, q = pick_drafts(logits, temp, self.generator, probs is not None, **keys)
        if q is not None:
            probs[prow + j] = q
        draft_tokens[req, j] = tokens
