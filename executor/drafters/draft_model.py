"""Draft-model drafting: a small model with the target's tokenizer proposes a chain of tokens.

One round of drafting for all speculating requests together:

    step 0   one ragged forward: per request the context tokens the drafter has no KV for yet
             (catch-up after AR rounds or a prefill, at least the last committed token); the last
             row of each request yields draft x_1;
    step j   one forward of one row per request that still drafts: x_j at its position, yielding
             x_{j+1} (j = 1 .. num_draft - 1).

The drafter keeps its own paged KV cache, indexed by the *target's* block ids: every position the
drafter writes in a round (the catch-up positions, then `len(context) - 1 + j` for j < num_draft)
lies below `num_computed + 1 + num_draft`, which the scheduler has already allocated blocks for, and
the valid draft KV after the round (see `commit`) never reaches past the target's committed length,
whose blocks the scheduler keeps. So no second allocator is needed; the cache only doubles the
bytes per block (`KVCache.blocks_for_budget` counts both models).

Draft probabilities: a greedy request drafts the argmax. A sampled request draws x_j from
`q = softmax(draft_logits / temperature)` at the request's temperature (no top-k/top-p: rejection
sampling is exact for any q the drafts were really drawn from, so q only has to be honest) and
`DraftBatch.probs` keeps q for every draft row; greedy rows there hold the point mass of their
argmax. The draft model must share the target's vocabulary (the rows are indexed by token id).

Graphs: a small model's step is bound by kernel launches when run eagerly (a 28-layer 0.6B model
took 12 to 17 ms per step at any batch on an H200, so a depth-8 chain cost more than the target's
round). On a GPU, step 0 replays a captured decode graph of the draft model (`executor/graphs.py`,
keyed by row bucket and block-table width) in passes of at most `GRAPH_MAX_ROWS_PER_SEQ` rows per
request, so a catch-up of a few AR rounds' tokens stays graphed (a catch-up longer than
`MAX_CATCHUP_PASSES` passes runs as one eager forward), and every chain step replays one. With
graphs a step is bound by the device, not the host: on an H200 at 1024 tokens of context a
0.6B-shaped model's step is about 1.2 ms of kernels at one request (some 300 kernels of 1.5 to
12 us, latency-bound) and at 64 requests mostly attention reading the draft KV (about 70 us a
layer). Capturing the whole chain as one graph measured no faster (per proposal, 1 to 64
requests: from 0.8% slower to 5.7% faster; a GPU test at 8 requests: 11% slower), so steps
replay one by one.

Wide forwards (a prefill chunk the drafter follows, a catch-up longer than the step-0 passes take)
replay graphs too: a second graph set without logits (`DecodeGraphs(logits=False)`), keyed by the
row buckets of `WIDE_BUCKETS` and the block-table width, whose attention is planned for sequences
of `WIDE_ROWS_HINT` rows (its tiles cover any ragged mix). Eagerly such a forward cost the host
14 to 21 ms of launches for 1.8 ms of device work at 256 rows (H200, 0.6B-shaped model); replayed,
it costs its device time. The picked rows' logits are computed after the replay, eagerly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np
import torch

from executor.drafters.base import DraftBatch, DraftRequest
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
# Row buckets of the wide (hidden-state) graphs; a wide forward of more rows runs eagerly. Steps of
# 256 near the top: a pass pads only to its bucket, and a whole prompt's catch-up lands there.
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
        self.kv = KVCache.allocate(
            model.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )
        # Per slot: positions [0, kv_len) hold valid draft KV for the slot's committed context.
        self.kv_len = np.zeros(max_slots, dtype=np.int64)  # [max_slots]
        # The executor's host block table [max_slots, max_blocks_per_seq] int32, shared by
        # reference: the executor writes a round's new block ids before it asks for drafts.
        self.block_tables: np.ndarray | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

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
        whole prompt in one eager forward of its own, bound by the host (on an H200 a 256-row
        catch-up of a 0.6B model is 1.8 ms of device work behind 14-21 ms of launches). Issued
        after the target's eager prefill forward of the same round, the launches overlap that
        forward's device time instead."""
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

        # Host plan of the whole chain, uploaded once: no step below waits for the device.
        # Entries of step j (j = 0 .. max_draft-1) are the requests that still draft there.
        active = np.flatnonzero(num_drafts > 0)  # [n0] request indices, step 0
        ctx_lens = np.array([len(requests[i].context) for i in active], dtype=np.int64)
        slots = np.array([requests[i].slot for i in active], dtype=np.int64)
        too_far = ctx_lens + num_drafts[active] - 1 > self.max_position
        if too_far.any():
            k = int(np.flatnonzero(too_far)[0])
            r = requests[int(active[k])]
            raise ValueError(
                f"slot {r.slot}: drafting {r.num_draft} tokens after {len(r.context)} would write "
                f"position {len(r.context) + r.num_draft - 2}; the drafter covers "
                f"{self.max_position}"
            )
        steps = [np.arange(len(active))]  # per step: positions in `active` still drafting
        steps += [np.flatnonzero(num_drafts[active] > j) for j in range(1, max_draft)]
        step_off = np.concatenate([[0], np.cumsum([len(x) for x in steps])])  # [max_draft + 1]
        local = np.concatenate(steps)  # [E] index into `active` per entry
        width = -(-int((ctx_lens + num_drafts[active]).max()) // self.block_size)
        # E = sum(num_draft): every draft is one entry of the step that makes it, so the drafts'
        # flat index in request order (request * max_draft + j) fits the same E columns
        draft_owner = np.repeat(np.arange(num_reqs), num_drafts)  # [E] request order
        flat_index = draft_owner * max_draft + np.arange(len(local)) - draft_offsets[draft_owner]
        plan_i64 = np.stack(
            [
                active[local],  # request index
                local,  # row of the uploaded block-table rows
                ctx_lens[local] - 1,  # position of the last committed token
                draft_offsets[active[local]],  # first probs row of the request
                flat_index,  # (request order, not step order) draft_tokens' flat index
            ]
        )  # [5, E]
        up_i64 = torch.from_numpy(plan_i64).to(dev, non_blocking=True)
        up_temps = torch.from_numpy(temps[active[local]]).to(dev, non_blocking=True)  # [E]
        up_tables = torch.from_numpy(np.ascontiguousarray(self.block_tables[slots, :width])).to(
            dev, non_blocking=True
        )  # [n0, width]

        def entries(j: int):
            sl = slice(int(step_off[j]), int(step_off[j + 1]))
            return up_i64[0, sl], up_i64[1, sl], up_i64[2, sl], up_i64[3, sl], up_temps[sl]

        # step 0: catch-up rows and the last committed token
        num_catchup_rows = self._step0(
            requests, active, ctx_lens, slots, entries(0), draft_tokens, probs
        )
        clock.mark()
        for slot, ctx_len in zip(slots.tolist(), ctx_lens.tolist()):
            # the whole context now has draft KV; the drafts' KV becomes valid in `commit`
            self.kv_len[slot] = ctx_len

        self._chain_steps(max_draft, steps, entries, up_tables, draft_tokens, probs)

        clock.mark()
        tokens_dev = draft_tokens.view(-1).index_select(0, up_i64[4])  # [E] request order
        done = None
        if tokens_dev.is_cuda:  # into pinned memory, without waiting
            tokens_host = torch.empty(len(local), dtype=torch.int64, pin_memory=True)
            tokens_host.copy_(tokens_dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            tokens_host = tokens_dev

        def resolve(batch: DraftBatch) -> None:
            t_wait = time.perf_counter()
            if done is not None:
                done.synchronize()  # the drafts' one device->host copy
            flat = tokens_host.tolist()
            wait_ms = (time.perf_counter() - t_wait) * 1e3
            # Catch-up time: what step 0 cost beyond a plain chain step (the mean of steps
            # 1..). A single draft has no plain step to compare with: then the catch-up rows'
            # share of step 0 stands in.
            catchup_ms = 0.0
            if num_catchup_rows:
                first_ms, chain_ms = clock.intervals_ms()
                if max_draft > 1:
                    step_ms = chain_ms / (max_draft - 1)
                    catchup_ms = max(first_ms - step_ms, 0.0)
                else:
                    catchup_ms = first_ms * num_catchup_rows / (num_catchup_rows + len(active))
            batch.tokens = [flat[a:b] for a, b in itertools.pairwise(draft_offsets.tolist())]
            batch.catchup_ms = catchup_ms
            # wait_ms: host time waiting for the device at the drafts' copy (host-bound
            # drafting waits little, device-bound drafting much; a deferred batch resolved
            # after the round's forward hardly at all)
            batch.extra = {"num_catchup_rows": num_catchup_rows, "wait_ms": wait_ms}

        batch = DraftBatch(tokens=None, probs=probs, tokens_dev=tokens_dev, resolver=resolve)
        if not defer:
            batch.resolve()
        return batch

    def _step0(self, requests, active, ctx_lens, slots, entries0, draft_tokens, probs) -> int:
        """Step 0: per request the context rows the drafter has no KV for (at least the last
        committed token), the last row's logits picking draft x_1. One ragged forward, or with
        graphs passes of `catchup_rows_per_pass` rows per request (a request leaves the passes
        at the one holding its last row). Returns the number of catch-up rows."""
        first_pos, num_rows = [], []
        for i, ctx_len in zip(active.tolist(), ctx_lens.tolist()):
            start = min(int(self.kv_len[requests[i].slot]), ctx_len - 1)
            first_pos.append(start)
            num_rows.append(ctx_len - start)
        per_pass = self.catchup_rows_per_pass or max(num_rows)
        num_passes = -(-max(num_rows) // per_pass)
        req, _, _, prow, temp = entries0
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

    def _chain_steps(self, max_draft, steps, entries, up_tables, draft_tokens, probs) -> None:
        """Steps 1 .. max_draft-1 one forward each: one row per request still drafting, its
        metadata computed on the device."""
        dev = self.device
        bs = self.block_size
        arange = torch.arange(len(steps[0]) + 1, dtype=torch.int32, device=dev)
        for j in range(1, max_draft):
            req, row, last_pos, prow, temp = entries(j)
            n = len(steps[j])
            positions = last_pos + j  # [n]
            tables = up_tables[row]  # [n, width]
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
        """Draft j of every row, on the device: the argmax for greedy rows; a draw from
        softmax(logits / temperature) for sampled ones, whose distribution goes to `probs`
        (greedy rows there hold the point mass of their argmax)."""
        tokens = logits.argmax(dim=-1)  # [n]
        if probs is not None:
            sampled = temp > 0.0  # [n]
            q = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)  # [n, vocab]
            drawn = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
            tokens = torch.where(sampled, drawn, tokens)
            point = torch.zeros_like(q).scatter_(1, tokens[:, None], 1.0)
            probs[prow + j] = torch.where(sampled[:, None], q, point)
        draft_tokens[req, j] = tokens


class DeviceClock:
    """Times consecutive phases of work queued on a device without waiting for it: CUDA events
    on a GPU (read after the proposal's one copy back has synchronised), the host clock on a
    CPU, where the work runs as it is issued."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.marks = [self.now()]

    def now(self):
        """A mark of the device's timeline at this point of the queued work."""
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, a, b) -> float:
        """Milliseconds from mark a to mark b (the device must have passed b)."""
        return a.elapsed_time(b) if self.events else (b - a) * 1e3

    def mark(self) -> None:
        self.marks.append(self.now())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks."""
        return [self.ms(a, b) for a, b in zip(self.marks, self.marks[1:])]
