"""Per-slot recurrent state of a hybrid target's linear-attention layers, and its journals.

The executor owns one state slot per request slot: the short convolution's last K-1 inputs and
the delta rule's state, for every linear layer. `setup` zeroes a slot's state when a request
enters it, `release` frees it; both ride on the slot's own set-up and release, so every path
that frees KV (finish, abort, preemption) frees state too. A state cannot be shared: a cached
prefix is refused at set-up (a hybrid target is served with prefix caching off).

In a forward, prefill chunks and AR rows always commit, so their state is updated in place.
A SPEC group's rows journal instead and leave the slot untouched. The journal is compact: per
row its conv input and the delta rule's (k, g, u) (`kernels.gated_delta_recurrent`), not the
states after it, so `commit` with j accepted drafts rebuilds the conv state from the slot's and
rows 0..j, and replays j + 1 rank-1 updates on the slot's delta state; rejected rows leave no
trace. Per row and linear layer that is C + Hk Dk + Hv + Hv Dv values against (K-1) C + Hv Dk Dv.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.model_config import ModelConfig


@dataclass
class RoundStates:
    """One forward's layout over the state slots, built on the host from the round's groups,
    and the journal its SPEC groups write."""

    states: RecurrentStates
    num_rows: int
    slots: torch.Tensor  # [m] int64 the state slot of each sequence
    host_slots: np.ndarray  # [m] the same on the host (commit reads it without a sync)
    conv_index: torch.Tensor  # [R, K] into (rows | each sequence's K-1 conv inputs)
    kept_seqs: torch.Tensor  # [k] sequences whose conv state is updated in place
    kept_index: torch.Tensor  # [k, K-1] their next conv state, same indexing
    # recurrent rows (AR rows and SPEC groups): slot, first row, rows, journal start (-1: AR)
    rec_seqs: torch.Tensor  # [4, r] int64
    # prefill chunks in chunks
    chunk_slots: torch.Tensor  # [c]
    chunk_rows: torch.Tensor  # [sum rows] their rows, sequence after sequence
    chunk_cu: list[int]  # [c + 1]
    # the journal: SPEC groups' rows, group after group
    journal_seqs: np.ndarray  # [j] sequence index of each journaled group
    journal_start: np.ndarray  # [j] its first row in the journal
    journal_rows: torch.Tensor  # [J] their rows in the batch
    conv_journal: torch.Tensor | None = None  # [layers, J, C] each row's conv input
    k_journal: torch.Tensor | None = None  # [layers, J, Hk, Dk] fp32 l2-normed k
    g_journal: torch.Tensor | None = None  # [layers, J, Hv] fp32 decay
    u_journal: torch.Tensor | None = None  # [layers, J, Hv, Dv] fp32 beta (v - S'^T k)

    def delta_journal(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        if self.k_journal is None:
            return None
        return self.k_journal[layer], self.g_journal[layer], self.u_journal[layer]


class RecurrentStates:
    def __init__(self, config: ModelConfig, max_slots: int, dtype: torch.dtype, device):
        la = config.linear_attn
        self.config = config
        self.num_layers = len(config.linear_layer_ids)
        self.kernel = la.conv_kernel
        self.device = torch.device(device)
        n, s, w = self.num_layers, max_slots, la.conv_kernel - 1
        self.conv = torch.zeros((n, s, w, la.conv_dim), dtype=dtype, device=device)
        self.ssm = torch.zeros(
            (n, s, la.num_value_heads, la.key_head_dim, la.value_head_dim),
            dtype=torch.float32,
            device=device,
        )
        self.in_use = np.zeros(max_slots, dtype=bool)
        self._journals: dict[int, RoundStates] = {}  # round id -> a launched round's journal
        # the fused kernels where they run natively, their torch references elsewhere
        from kernels import gated_delta_recurrent as gdr
        from kernels.arch import kernels_available

        native = kernels_available(self.device)
        self.delta_rows = gdr.gated_delta_rows if native else gdr.gated_delta_rows_ref
        self.replay = gdr.replay_journal if native else gdr.replay_journal_ref

    @classmethod
    def for_model(cls, model, max_slots: int) -> RecurrentStates:
        return cls(model.config, max_slots, model.dtype, model.device)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype_bytes: int) -> int:
        """Memory one slot's state takes (conv inputs in the model dtype, delta state fp32)."""
        la = config.linear_attn
        conv = (la.conv_kernel - 1) * la.conv_dim * dtype_bytes
        ssm = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
        return len(config.linear_layer_ids) * (conv + ssm)

    @staticmethod
    def journal_bytes_per_row(config: ModelConfig, dtype_bytes: int, compact: bool = True) -> int:
        """Journal memory one SPEC row takes: the compact journal (its conv input, k, g, u),
        or (`compact=False`) the states after the row that it replaces."""
        la = config.linear_attn
        if compact:
            conv = la.conv_dim * dtype_bytes
            delta = (la.key_dim + la.num_value_heads + la.value_dim) * 4
        else:
            conv = (la.conv_kernel - 1) * la.conv_dim * dtype_bytes
            delta = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
        return len(config.linear_layer_ids) * (conv + delta)

    @property
    def num_free(self) -> int:
        return int((~self.in_use).sum())

    @property
    def num_pending_journals(self) -> int:
        return len(self._journals)

    def setup(self, slot: int, num_cached_tokens: int = 0) -> None:
        if num_cached_tokens:
            raise ValueError(
                f"slot {slot}: a hybrid target's recurrent state cannot start from "
                f"{num_cached_tokens} cached tokens; serve it with prefix caching off"
            )
        if self.in_use[slot]:
            raise RuntimeError(f"state slot {slot} is still in use")
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        self.in_use[slot] = True

    def release(self, slot: int) -> None:
        self.in_use[slot] = False

    def begin_round(
        self,
        round_id: int,
        slots: np.ndarray,  # [m] slot of each sequence, in row order
        group_rows: np.ndarray,  # [m + 1]
        num_draft: np.ndarray,  # [n <= m] drafts of the first n sequences (0: AR)
    ) -> RoundStates:
        """The layout of one forward; its journal is kept under `round_id` until `commit`."""
        rs = _layout(self, slots, group_rows, num_draft)
        if len(rs.journal_seqs):
            la, n, dev = self.config.linear_attn, self.num_layers, self.device
            j = len(rs.journal_rows)
            rs.conv_journal = torch.empty((n, j, la.conv_dim), dtype=self.conv.dtype, device=dev)
            f32 = dict(dtype=torch.float32, device=dev)
            rs.k_journal = torch.empty((n, j, la.num_key_heads, la.key_head_dim), **f32)
            rs.g_journal = torch.empty((n, j, la.num_value_heads), **f32)
            rs.u_journal = torch.empty((n, j, la.num_value_heads, la.value_head_dim), **f32)
            self._journals[round_id] = rs
        return rs

    def commit(self, round_id: int, own: np.ndarray, num_accepted: np.ndarray) -> None:
        """Advances, for each journaled group whose request still holds its slot (`own` [m]),
        the slot's state by its rows 0..`num_accepted` [m] (row 0 is the last committed
        token): the conv state from the slot's and those rows' inputs, the delta state by
        replaying their journal."""
        rs = self._journals.pop(round_id, None)
        if rs is None:
            return
        seqs = rs.journal_seqs
        keep = own[seqs]
        if not keep.any():
            return
        start = rs.journal_start[keep]  # [G]
        num_rows = num_accepted[seqs[keep]].astype(np.int64) + 1  # [G]
        slots = rs.host_slots[seqs[keep]]
        # one upload: the replay's groups and the conv state's sources
        width, num_groups = self.kernel - 1, len(start)
        pos = num_rows[:, None] - width + np.arange(width)  # [G, K-1] input index, < 0: old
        src = np.where(
            pos >= 0,
            num_groups * width + start[:, None] + pos,
            np.arange(num_groups)[:, None] * width + width + pos,
        )
        packed = _dev(np.concatenate([slots, start, num_rows, src.ravel()]), self.device)
        groups, conv_src = packed[: 3 * num_groups].view(3, -1), packed[3 * num_groups :]
        slot_idx = groups[0]
        old = self.conv.index_select(1, slot_idx).flatten(1, 2)  # [L, G (K-1), C]
        inputs = torch.cat([old, rs.conv_journal], dim=1)  # [L, G (K-1) + J, C]
        new = inputs.index_select(1, conv_src).view(self.num_layers, num_groups, width, -1)
        self.conv.index_copy_(1, slot_idx, new)
        self.replay(self.ssm, groups, rs.k_journal, rs.g_journal, rs.u_journal)


def _layout(
    states: RecurrentStates, slots: np.ndarray, group_rows: np.ndarray, num_draft: np.ndarray
) -> RoundStates:
    """Index arrays of one forward (host numpy, uploaded once; every layer reuses them)."""
    dev, width = states.device, states.kernel - 1
    m = len(slots)
    lens = np.diff(group_rows).astype(np.int64)  # [m]
    num_rows = int(group_rows[-1])
    journaled = np.zeros(m, dtype=bool)
    journaled[: len(num_draft)] = np.asarray(num_draft) > 0
    recurrent = journaled | (lens == 1)

    def source(seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Index of input `pos` (< 0: the conv state's entry K-1+pos) of sequence `seq`."""
        return np.where(pos >= 0, group_rows[seq] + pos, num_rows + seq * width + width + pos)

    owner = np.repeat(np.arange(m), lens)  # [R]
    t = np.arange(num_rows) - group_rows[owner]
    conv_index = source(owner[:, None], t[:, None] - width + np.arange(width + 1))  # [R, K]
    kept = np.flatnonzero(~journaled)
    kept_index = source(kept[:, None], lens[kept, None] - width + np.arange(width))

    rec = np.flatnonzero(recurrent)
    journal_seqs = np.flatnonzero(journaled)
    journal_start = np.concatenate([[0], np.cumsum(lens[journal_seqs])[:-1]]).astype(np.int64)
    start_of = np.full(m, -1, dtype=np.int64)
    start_of[journal_seqs] = journal_start
    rec_seqs = np.stack([slots[rec], group_rows[rec], lens[rec], start_of[rec]])  # [4, r]
    chunk = np.flatnonzero(~recurrent)
    chunk_rows = [np.arange(group_rows[i], group_rows[i + 1]) for i in chunk]
    return RoundStates(
        states=states,
        num_rows=num_rows,
        slots=_dev(slots, dev),
        host_slots=np.asarray(slots, dtype=np.int64),
        conv_index=_dev(conv_index, dev),
        kept_seqs=_dev(kept, dev),
        kept_index=_dev(kept_index, dev),
        rec_seqs=_dev(rec_seqs, dev),
        chunk_slots=_dev(slots[chunk], dev),
        chunk_rows=_dev(np.concatenate(chunk_rows) if len(chunk) else np.zeros(0), dev),
        chunk_cu=np.concatenate([[0], np.cumsum(lens[chunk])]).astype(int).tolist(),
        journal_seqs=journal_seqs,
        journal_start=journal_start,
        journal_rows=_dev(
            np.concatenate([np.arange(group_rows[i], group_rows[i + 1]) for i in journal_seqs])
            if len(journal_seqs)
            else np.zeros(0),
            dev,
        ),
    )


def _dev(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.int64), device=device)
