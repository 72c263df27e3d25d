"""Block drafting: every speculating request's whole block drafted in one forward of a small
drafter that reads the target's own hidden states (DFlash layout, `block_model.py`).

The drafter's context is K/V projected from target states, kept in a paged cache of its own
under the *target's* block ids. The executor hands it the captured states of every row of every
target forward (`extend_context`, right after the forward, on the device): rows that commit
leave valid context K/V at their positions; rejected drafts leave K/V past the committed end,
overwritten when the target computes those positions again, exactly like the target's own KV.
So the context never lags: no catch-up after AR rounds or prefill chunks, no rollback work.

A round's proposal is one forward of all blocks, ragged: per request B rows at positions
L-1 .. L+B-2 (L = committed tokens; row 0 is the last token, the others the mask token), every
row attending to the whole context and the whole block (non-causal). The block's K/V go into the
cache past the committed end, which the scheduler allocates for (`kv_lookahead`). Draft j is row
j's prediction; the executor verifies the first num_draft of them, however many the policy
chose, so the drafting cost does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor.device_clock import DeviceClock
from executor.drafters.base import DraftBatch, DraftRequest
from executor.drafters.block_model import BlockDraftModel
from executor.drafters.draft_chain import drafts_resolver
from executor.drafters.draft_pick import DrawKeys, pick_drafts
from executor.drafters.rerank import OnlineReranker
from executor.graphs import DEFAULT_BUCKETS, DecodeGraphs, bucket_for
from executor.kv_cache import KVCache
from executor.model import AttnMetadata


class BlockDrafter:
    """Drafts blocks with `model`; see the module docstring for how its context stays exact."""

    name = "block"
    has_probs = True
    follows_prefill = False  # the context comes from every target forward instead

    def __init__(
        self,
        model: BlockDraftModel,
        *,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        max_model_len: int,
        seed: int = 0,
        graphs: str = "lazy",
        reranker: OnlineReranker | None = None,
    ):
        if graphs not in ("lazy", "startup", "off"):
            raise ValueError(f"graphs must be lazy, startup or off, got {graphs!r}")
        cfg = model.config
        self.reranker = reranker
        self.model = model
        self.device = model.device
        self.block_size = block_size  # the KV page size
        self.block_len = cfg.block_size  # rows of one drafted block
        self.max_slots = max_slots
        # Positions past the committed end a speculating round writes: the block's.
        self.kv_lookahead = cfg.block_size - 1
        self.capture_layer_ids = cfg.target_layer_ids
        self.mask_token_id = cfg.mask_token_id
        self.max_position = min(max_model_len, model.decoder.max_position)
        self.kv = KVCache.allocate(
            cfg.decoder,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.decoder.kv_cache_dtype,
            device=model.device,
        )
        self.use_graphs = graphs != "off" and model.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.block_tables: np.ndarray | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def bind_block_tables(self, block_tables: np.ndarray) -> None:
        """Called once by the executor with its block table; the drafter only reads it."""
        self.block_tables = block_tables
        if self.use_graphs:
            rows = bucket_for(self.block_len * self.max_slots) or DEFAULT_BUCKETS[-1]
            self.graphs = DecodeGraphs(
                self.model.decoder,
                self.kv.k,
                self.kv.v,
                max_seqs=self.max_slots,
                max_blocks_per_seq=block_tables.shape[1],
                max_rows=rows,
                logits=False,
                causal=False,
            )

    @property
    def num_graphs(self) -> int:
        return 0 if self.graphs is None else len(self.graphs.graphs)

    # -- slot lifecycle: the context lives in the cache under the target's blocks ------------
    def setup(self, slot: int, context: list[int]) -> None:
        if self.reranker is not None:
            self.reranker.start(slot, context)

    def release(self, slot: int) -> None:
        if self.reranker is not None:
            self.reranker.release(slot)

    def commit(self, slot: int, context: Sequence[int], num_accepted: int, num_draft: int) -> None:
        if self.reranker is not None:  # trains on the blocks the committed text now covers
            self.reranker.sync(slot, context)

    def extend_context(
        self,
        target_hidden: torch.Tensor,  # [rows, len(layer ids) * hidden] captured this forward
        positions: torch.Tensor,  # [rows] int64
        slot_mapping: torch.Tensor,  # [rows] int64, < 0: padding
    ) -> None:
        """Context K/V of every row of a target forward, enqueued right after it."""
        self.model.write_context(target_hidden, positions, slot_mapping, self.kv.k, self.kv.v)

    # -- drafting -----------------------------------------------------------------------------
    def propose(
        self, requests: list[DraftRequest], greedy: list[bool], defer: bool = False
    ) -> DraftBatch:
        if self.block_tables is None:
            raise RuntimeError("BlockDrafter needs the executor's block table (bind it)")
        num_drafts = np.array([r.num_draft for r in requests], dtype=np.int64)  # [n]
        if not num_drafts.any():
            return DraftBatch(tokens=[[] for _ in requests])
        clock = DeviceClock(self.device)
        dev = self.device
        ctx_lens = np.array([len(r.context) for r in requests], dtype=np.int64)  # [n]
        # The block runs from the last committed token; near the context limit it is shorter.
        block_lens = np.minimum(self.block_len, self.max_position - ctx_lens + 1)  # [n]
        short = np.flatnonzero(block_lens < num_drafts + 1)
        if len(short):
            r = requests[int(short[0])]
            raise ValueError(
                f"slot {r.slot}: {r.num_draft} drafts after {len(r.context)} tokens need "
                f"positions past {self.max_position} (block of {self.block_len})"
            )
        meta, row_starts = self._block_meta(requests, ctx_lens, block_lens)
        ids = np.full(int(block_lens.sum()), self.mask_token_id, dtype=np.int64)  # [rows]
        ids[row_starts] = [int(r.context[-1]) for r in requests]
        draft_offsets = np.concatenate([[0], np.cumsum(num_drafts)]).astype(np.int64)
        # draft j (1-based) of request i is the block's row j
        draft_rows = np.repeat(row_starts - draft_offsets[:-1], num_drafts) + np.arange(
            1, int(draft_offsets[-1]) + 1
        )  # [E]
        temps = np.array(
            [0.0 if g else max(r.temperature, 1e-5) for r, g in zip(requests, greedy)],
            dtype=np.float32,
        )
        ids_t = torch.from_numpy(ids).to(dev, non_blocking=True)
        rows_t = torch.from_numpy(draft_rows).to(dev, non_blocking=True)
        temp_t = torch.from_numpy(np.repeat(temps, num_drafts)).to(dev, non_blocking=True)
        logits = self._block_logits(ids_t, meta, rows_t)  # [E, vocab]
        keys = {}
        draw_keys = DrawKeys.of_requests(requests, dev) if temps.any() else None
        if draw_keys is not None:
            owner = np.repeat(np.arange(len(requests)), num_drafts)  # [E]
            offset = np.arange(len(owner)) - draft_offsets[owner]  # [E] draft index - 1
            keys = draw_keys.rows(torch.from_numpy(owner).to(dev), torch.from_numpy(offset).to(dev))
        tokens_dev, probs = pick_drafts(logits, temp_t, self.generator, bool(temps.any()), **keys)
        if self.reranker is not None and any(greedy):
            tokens_dev = self._rerank(requests, greedy, num_drafts, logits, tokens_dev)
            if probs is not None:  # greedy rows' point mass on the draft they now carry
                point = torch.zeros_like(probs).scatter_(1, tokens_dev[:, None], 1.0)
                probs = torch.where((temp_t > 0)[:, None], probs, point)
        clock.mark()
        resolve = drafts_resolver(
            tokens_dev, clock, 0, int(num_drafts.max()), len(requests), draft_offsets
        )
        batch = DraftBatch(tokens=None, probs=probs, tokens_dev=tokens_dev, resolver=resolve)
        if not defer:
            batch.resolve()
        return batch

    def _rerank(
        self,
        requests: list[DraftRequest],
        greedy: list[bool],
        num_drafts: np.ndarray,  # [n]
        logits: torch.Tensor,  # [E, vocab] the draft rows' logits
        tokens_dev: torch.Tensor,  # [E] the drafts picked on the device
    ) -> torch.Tensor:
        """The greedy requests' drafts re-chosen by the reranker among each row's top-k (one
        wait for the block, one copy of the candidates each way). -> drafts [E] on the device"""
        reranker = self.reranker
        top = logits.topk(reranker.k, dim=-1)  # [E, k] in rank order
        cand_ids, cand_logits = top.indices.cpu().numpy(), top.values.cpu().numpy()
        offsets = np.concatenate([[0], np.cumsum(num_drafts)])
        members = [i for i, g in enumerate(greedy) if g and num_drafts[i]]
        rows_max = int(num_drafts[members].max())
        ids = np.zeros((len(members), rows_max, reranker.k), dtype=np.int64)
        vals = np.zeros((len(members), rows_max, reranker.k), dtype=np.float32)
        for m, i in enumerate(members):
            a, b = int(offsets[i]), int(offsets[i + 1])
            ids[m, : b - a], vals[m, : b - a] = cand_ids[a:b], cand_logits[a:b]
        slots = [requests[i].slot for i in members]
        for i in members:
            reranker.sync(requests[i].slot, requests[i].context)
        chosen = reranker.rerank(slots, ids, vals, num_drafts[members])  # [m, R]
        tokens = tokens_dev.cpu().numpy().copy()  # [E]
        for m, i in enumerate(members):
            a, b = int(offsets[i]), int(offsets[i + 1])
            tokens[a:b] = chosen[m, : b - a]
        return torch.from_numpy(tokens).to(self.device, non_blocking=True)

    def _block_logits(
        self, ids: torch.Tensor, meta: AttnMetadata, draft_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits [E, vocab] of the draft rows; the blocks replay a graph where one fits."""
        model = self.model
        bucket = bucket_for(len(ids))
        if self.graphs is None or not 0 < bucket <= self.graphs.max_rows:
            return model.block_logits(ids, meta, self.kv.k, self.kv.v, draft_rows)
        hidden = self.graphs.replay(bucket, ids, meta, self.block_len)  # [rows, hidden]
        return model.decoder.logits(hidden[draft_rows])

    def _block_meta(
        self, requests: list[DraftRequest], ctx_lens: np.ndarray, block_lens: np.ndarray
    ) -> tuple[AttnMetadata, np.ndarray]:
        """One sequence per block: its rows at positions L-1 .. L+b-2, seeing L-1+b tokens.
        Returns the metadata and each block's first row [n]."""
        assert self.block_tables is not None
        bs = self.block_size
        slots = np.array([r.slot for r in requests], dtype=np.int64)  # [n]
        first = ctx_lens - 1  # [n] position of the last committed token
        row_starts = np.concatenate([[0], np.cumsum(block_lens)[:-1]]).astype(np.int64)
        rows_slot = np.repeat(slots, block_lens)  # [rows]
        pos = np.repeat(first - row_starts, block_lens) + np.arange(int(block_lens.sum()))
        slot_mapping = self.block_tables[rows_slot, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = first + block_lens  # [n]
        width = -(-int(seq_lens.max()) // bs)
        dev = self.device
        meta = AttnMetadata(
            positions=torch.from_numpy(pos).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            cu_q_lens=torch.from_numpy(
                np.concatenate([[0], np.cumsum(block_lens)]).astype(np.int32)
            ).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(
                np.ascontiguousarray(self.block_tables[slots, :width])
            ).to(dev, non_blocking=True),
            max_q_len=int(block_lens.max()),
        )
        return meta, row_starts
