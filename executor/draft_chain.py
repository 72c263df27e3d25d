"""A draft model's greedy chain steps 1 .. S as one captured graph.

Step j of a chain (see `executor/drafters/draft_model.py`) feeds draft x_j of every request at
position `last_pos + j` and yields x_{j+1} by argmax. Replayed step by step, each step costs the
host a graph launch plus a dozen small metadata kernels (positions, slot mapping, sequence
lengths, the argmax and its scatter), and a 0.6B model's step is short enough that the device
waits for them. Here the whole chain, metadata included, is one graph: one launch per round.

Static inputs, per row r of the padded batch (padded rows have `num_draft = 0`):

    first_tok [max_seqs]            x_1 of each request (from step 0)
    last_pos  [max_seqs]            position of the request's last committed token
    num_draft [max_seqs]            drafts the request wants (it takes part in steps j < num_draft)
    tables    [max_seqs, max_blocks] the request's block table (row 0 of padded rows: a valid id)

A request with `num_draft <= j` sits step j out without leaving the batch: its row is placed at
its last written position (so every read stays inside its own allocation and the table's width),
writes no KV (slot -1) and its argmax is ignored. Output: `tokens[r, j - 1]` = x_{j+1}.

Graphs are keyed by (row bucket, block-table width, steps); a chain of fewer steps replays the
shortest captured one that is long enough (its extra steps write nothing), so one capture per
bucket and width at the serving depth covers every round.
"""

from __future__ import annotations

import logging

import torch

from executor.model import AttnMetadata, Model

log = logging.getLogger("hipfire_serve.graphs")


class ChainGraphs:
    def __init__(
        self,
        model: Model,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        capture: bool = True,
        pool_source=None,
    ):
        dev = model.device
        self.model = model
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # capture=False runs the same chain eagerly from the same buffers (CPU, tests)
        self.capture_enabled = capture and dev.type == "cuda"
        # An object with a `pool` attribute (the drafter's `DecodeGraphs`) whose graph memory
        # pool the chains share: the two never replay at once, so intermediates can overlap.
        self.pool_source = pool_source
        self.pool = None
        self.first_tok = torch.zeros(max_seqs, dtype=torch.int64, device=dev)  # [max_seqs]
        self.last_pos = torch.zeros(max_seqs, dtype=torch.int64, device=dev)  # [max_seqs]
        self.num_draft = torch.zeros(max_seqs, dtype=torch.int64, device=dev)  # [max_seqs]
        self.tables = torch.zeros(
            max_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev
        )  # [max_seqs, max_blocks]
        self.cu_q_lens = torch.arange(max_seqs + 1, dtype=torch.int32, device=dev)  # one row each
        # (row bucket, width, steps) -> (graph, tokens [bucket, steps] written by the graph)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0

    def _body(self, bucket: int, width: int, steps: int, out: torch.Tensor) -> None:
        """Steps 1 .. `steps` over the first `bucket` rows of the static buffers -> out."""
        bs = self.block_size
        tok = self.first_tok[:bucket]  # [B]
        last = self.last_pos[:bucket]  # [B]
        nd = self.num_draft[:bucket]  # [B]
        tables = self.tables[:bucket, :width]  # [B, width]
        # the last position each row may use: last + num_draft - 1 (last itself for padding)
        top = (nd - 1).clamp_min(0)  # [B]
        for j in range(1, steps + 1):
            active = nd > j  # [B] rows whose x_j is a draft to feed
            pos = last + torch.clamp_max(top, j)  # [B] position j, or the row's last one
            block = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long()  # [B]
            slot = torch.where(active, block * bs + pos % bs, -1)  # [B]
            meta = AttnMetadata(
                positions=pos,
                slot_mapping=slot,
                cu_q_lens=self.cu_q_lens[: bucket + 1],
                seq_lens=(pos + 1).to(torch.int32),
                block_tables=tables,
                max_q_len=1,
            )
            hidden = self.model.forward(tok, meta, self.k_caches, self.v_caches)  # [B, hidden]
            tok = self.model.logits(hidden).argmax(dim=-1)  # [B], as the step-by-step path picks
            out[:, j - 1].copy_(tok)

    def _capture(self, bucket: int, width: int, steps: int) -> None:
        dev = self.model.device
        before = torch.cuda.memory_reserved(dev)
        out = torch.zeros(bucket, steps, dtype=torch.int64, device=dev)  # [B, steps]
        # Warm-up with every row idle (num_draft 0: no KV written) so kernels compile outside
        # the capture; then capture on the same idle batch.
        self.num_draft[:bucket].zero_()
        self.last_pos[:bucket].zero_()
        self.tables[:bucket, 0].zero_()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self._body(bucket, width, 1, out)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        source = self.pool_source
        pool = source.pool if source is not None and source.pool is not None else self.pool
        with torch.cuda.graph(graph, pool=pool):
            self._body(bucket, width, steps, out)
        if pool is None:
            self.pool = graph.pool()
            if source is not None:
                source.pool = self.pool
        self.graphs[(bucket, width, steps)] = (graph, out)
        self.memory_bytes += torch.cuda.memory_reserved(dev) - before
        log.debug("captured a %d-step draft chain for %d rows, %d blocks", steps, bucket, width)

    def capture(self, bucket: int, width: int, steps: int) -> None:
        if self.capture_enabled and (bucket, width, steps) not in self.graphs:
            self._capture(bucket, width, steps)

    def _pick(self, bucket: int, width: int, steps: int) -> tuple[int, int, int]:
        """The captured graph to replay: the fewest rows, then the fewest steps, that hold the
        chain at this width; captured now when none does."""
        fits = [k for k in self.graphs if k[0] >= bucket and k[1] == width and k[2] >= steps]
        if fits:
            return min(fits, key=lambda k: (k[0], k[2]))
        self._capture(bucket, width, steps)
        return (bucket, width, steps)

    def run(
        self,
        bucket: int,  # rows to run: a bucket >= the number of requests
        width: int,  # block-table width (a width bucket of the drafter's decode graphs)
        steps: int,  # chain steps wanted (max num_draft - 1)
        first_tok: torch.Tensor,  # [n] int64 x_1 per request
        last_pos: torch.Tensor,  # [n] int64
        num_draft: torch.Tensor,  # [n] int64
        tables: torch.Tensor,  # [n, nb] int32, nb <= width
    ) -> torch.Tensor:
        """Drafts x_2 .. x_{steps+1} of n requests -> [n, steps] int64 (entries past a
        request's num_draft - 1 are meaningless)."""
        n, nb = tables.shape
        assert n <= bucket <= self.max_seqs and nb <= width <= self.max_blocks_per_seq
        self.first_tok[:n].copy_(first_tok)
        self.last_pos[:n].copy_(last_pos)
        self.last_pos[n:bucket].zero_()
        self.num_draft[:n].copy_(num_draft)
        self.num_draft[n:bucket].zero_()
        self.tables[:n, :nb].copy_(tables)
        self.tables[n:bucket, 0].zero_()
        if not self.capture_enabled:
            out = torch.zeros(bucket, steps, dtype=torch.int64, device=self.model.device)
            self._body(bucket, width, steps, out)
            return out[:n]
        key = self._pick(bucket, width, steps)
        if key[0] > bucket:  # a wider graph's extra rows must idle too
            self.last_pos[bucket : key[0]].zero_()
            self.num_draft[bucket : key[0]].zero_()
            self.tables[bucket : key[0], 0].zero_()
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n, :steps]
