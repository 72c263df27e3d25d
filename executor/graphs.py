"""CUDA/HIP graphs for decode rounds, one per row bucket.

A decode round (AR rows and spec groups, no prefill) is replayed from a graph captured for its
padded row count and its block-table width (a power of two of blocks, so the attention kernel's
KV split count fits the context actually served instead of the longest possible one). Inputs
live in static buffers; a decode round has at most as many sequences as rows, so the sequence
dimension is min(row bucket, max_seqs); padded sequences have `q_len = 0` and `seq_len = 0` (the
attention kernel's programs for them exit at once), padded rows write no KV (slot -1). The graph
computes logits for every row of the bucket, since every decode row needs them; a graph set made
with `logits=False` returns the final-normed hidden states instead (a draft model's wide forwards:
prefill chunks and catch-ups, of which at most the last row per sequence needs logits). A
graph set made with a `HiddenCapture` also writes the chosen layers' hidden states into its
buffer, a static output of every graph: after a replay its first num_rows rows hold this round's.
A set made with `causal=False` replays a block drafter's blocks (non-causal attention).
A hybrid target gets none: its recurrent layers' per-round layout and journal are new tensors
every round, not static buffers, so its decode rounds run eagerly.
"""

from __future__ import annotations

import logging

import torch

from executor.hidden_capture import HiddenCapture
from executor.model import AttnMetadata, Model

log = logging.getLogger("hipfire_serve.graphs")

DEFAULT_BUCKETS = (
    1,
    2,
    4,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    80,
    96,
    112,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
    640,
    768,
    896,
    1024,
    1280,
    1536,
    1792,
    2048,
)


def bucket_for(num_rows: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket >= num_rows, or 0 when none fits (then the round runs eagerly)."""
    for b in buckets:
        if b >= num_rows:
            return b
    return 0


class DecodeGraphs:
    def __init__(
        self,
        model: Model,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        *,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_rows: int,
        logits: bool = True,
        capture: HiddenCapture | None = None,
        causal: bool = True,
    ):
        if getattr(model, "is_hybrid", False):
            raise ValueError(
                "decode graphs do not serve hybrid targets: their recurrent layers' per-round "
                "state layout and journal are not static buffers (run with graphs off)"
            )
        dev = model.device
        self.logits = logits
        self.causal = causal  # False: a block drafter's blocks (every row sees its block)
        if capture is not None and capture.max_rows < max_rows:
            raise ValueError(f"capture buffer has {capture.max_rows} rows, graphs need {max_rows}")
        self.capture_hidden = capture
        self.model = model
        self.k_caches, self.v_caches = k_caches, v_caches
        self.max_seqs = max_seqs
        self.max_rows = max_rows
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=dev)  # [max_rows]
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)  # [max_rows]
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.cu_q_lens = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.max_blocks_per_seq = max_blocks_per_seq
        # (row bucket, block-table width, rows per sequence bound) -> (graph, static output)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.memory_bytes = 0  # device memory taken by captures (graph pool growth)

    def width_for(self, num_blocks: int) -> int:
        """Block-table width bucket: the next power of two >= num_blocks, at least 64 blocks."""
        width = 64
        while width < num_blocks:
            width *= 2
        return min(width, self.max_blocks_per_seq)

    def _meta(self, rows: int, width: int, max_q_len: int) -> AttnMetadata:
        seqs = min(rows, self.max_seqs)
        return AttnMetadata(
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            cu_q_lens=self.cu_q_lens[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs, :width],
            max_q_len=max_q_len,
        )

    def _forward(self, rows: int, width: int, max_q_len: int) -> torch.Tensor:
        hidden = self.model.forward(
            self.input_ids[:rows],
            self._meta(rows, width, max_q_len),
            self.k_caches,
            self.v_caches,
            self.capture_hidden,
            causal=self.causal,
        )  # [rows, hidden]
        return self.model.logits(hidden) if self.logits else hidden  # [rows, vocab]

    def capture(self, bucket: int, width: int, max_q_len: int = 1) -> None:
        key = (bucket, width, max_q_len)
        if key in self.graphs:
            return
        before = torch.cuda.memory_reserved(self.model.device)
        # Capture on an all-padding batch: no KV is written, every attention program exits.
        self.slot_mapping.fill_(-1)
        self.cu_q_lens.zero_()
        self.seq_lens.zero_()
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles/autotunes outside the capture
                self._forward(bucket, width, max_q_len)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bucket, width, max_q_len)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, logits)
        self.memory_bytes += torch.cuda.memory_reserved(self.model.device) - before
        log.debug("captured graph for %d rows, %d blocks, %d rows/seq", bucket, width, max_q_len)

    def replay(
        self,
        bucket: int,
        input_ids: torch.Tensor,  # [num_rows] int64 on device
        meta: AttnMetadata,  # the rows' attention metadata, on the device
        max_q_len: int | None = None,  # rows per sequence to plan for (default meta's, or 1)
    ) -> torch.Tensor:
        """`run` on the rows `meta` describes."""
        if max_q_len is None:
            max_q_len = meta.max_q_len or 1
        return self.run(
            bucket,
            input_ids,
            meta.positions,
            meta.slot_mapping,
            meta.cu_q_lens,
            meta.seq_lens,
            meta.block_tables,
            max_q_len=max_q_len,
        )

    def run(
        self,
        bucket: int,
        input_ids: torch.Tensor,  # [num_rows] int64 on device
        positions: torch.Tensor,  # [num_rows]
        slot_mapping: torch.Tensor,  # [num_rows]
        cu_q_lens: torch.Tensor,  # [num_seqs + 1] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        block_tables: torch.Tensor,  # [num_seqs, nb] int32
        max_q_len: int = 1,  # most rows of one sequence this round
    ) -> torch.Tensor:
        """Returns logits [num_rows, vocab] (hidden states [num_rows, hidden] without logits), a
        view of the graph's static output: read it before the graph's next replay."""
        num_rows, num_seqs = input_ids.shape[0], seq_lens.shape[0]
        nb = block_tables.shape[1]
        width = self.width_for(nb)
        max_q_len = 1 << max(0, (max_q_len - 1).bit_length())  # power of two: few graphs
        self.capture(bucket, width, max_q_len)
        self.input_ids[:num_rows].copy_(input_ids)
        self.positions[:num_rows].copy_(positions)
        self.slot_mapping[:num_rows].copy_(slot_mapping)
        self.slot_mapping[num_rows:bucket].fill_(-1)
        self.cu_q_lens[: num_seqs + 1].copy_(cu_q_lens)
        self.cu_q_lens[num_seqs + 1 :].fill_(num_rows)  # padded sequences: q_len 0
        self.seq_lens[:num_seqs].copy_(seq_lens)
        self.seq_lens[num_seqs:].zero_()
        self.block_tables[:num_seqs, :nb].copy_(block_tables)
        graph, logits = self.graphs[(bucket, width, max_q_len)]
        graph.replay()
        return logits[:num_rows]
