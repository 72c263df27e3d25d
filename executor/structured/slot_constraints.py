"""Per-slot constraints of the round executor: a grammar matcher and a logit bias per slot, and
the inputs they give each round's logit rows.

A SPEC group of a constrained request verifies rows fed `[last, x_1 .. x_d]`; row j samples the
token after x_j, so its mask is the matcher's state after the committed output and the drafts
x_1 .. x_j. llguidance fills those masks in one call per round (its threads, without the GIL):
it consumes each draft, writes the next row, and rolls the drafts back, so the matcher's state
stays that of the committed tokens. A row after a draft the grammar rejects is never emitted
(that draft's probability is 0 in the masked row before it, so it is rejected), and a row after
the grammar is complete may only end the output: both keep the end-of-sequence mask. After the
round the matcher consumes the tokens the request committed, and only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from executor import sampling
from executor.host_buffer import HostBuffer
from executor.ragged_batch import RaggedBatch
from executor.structured.grammar import GrammarCompiler
from scheduler.plan import SamplingSpec


@dataclass(frozen=True)
class RoundConstraints:
    """What constrains one round's logit rows, on the host."""

    mask_rows: np.ndarray  # [G] int64 logit rows a grammar masks
    bitmask: np.ndarray  # [G, W] int32: bit t % 32 of word t // 32 set = token t allowed
    bias_rows: np.ndarray  # [K] int64 logit row of each bias entry
    bias_ids: np.ndarray  # [K] int64
    bias_values: np.ndarray  # [K] float32


@dataclass(frozen=True)
class DeviceConstraints:
    """A round's constraints on the device (views of one upload); `apply` is the only use."""

    mask_rows: torch.Tensor | None  # [G] int64; None: no grammar row
    bitmask: torch.Tensor | None  # [G, W] int32
    bias_rows: torch.Tensor | None  # [K] int64; None: no bias entry
    bias_ids: torch.Tensor | None  # [K] int64
    bias_values: torch.Tensor | None  # [K] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [L, V] -> the constrained logits [L, V]: bias first, then the grammar's mask,
        so that a bias never lifts a token the grammar forbids."""
        if self.bias_rows is not None:
            logits = sampling.apply_logit_bias(
                logits, self.bias_rows, self.bias_ids, self.bias_values
            )
        if self.mask_rows is not None:
            logits = sampling.apply_token_bitmask(logits, self.bitmask, self.mask_rows)
        return logits


class SlotConstraints:
    """Grammar matchers and logit biases by slot. `compiler` is set by the engine (a model
    without a tokenizer has none, and its requests cannot ask for a grammar)."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self.grammar = np.zeros(max_slots, dtype=bool)  # the slot's request has a matcher
        self.biased = np.zeros(max_slots, dtype=bool)
        self.num_active = 0  # slots with a grammar or a bias: 0 keeps rounds on the plain path
        self._matchers: list[llguidance.LLMatcher | None] = [None] * max_slots
        self._bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_slots
        self._eos_row: np.ndarray | None = None  # [W] int32: only the end of the output
        self._host = HostBuffer(device)

    @property
    def compiler(self) -> GrammarCompiler | None:
        return self._compiler

    @compiler.setter
    def compiler(self, compiler: GrammarCompiler | None) -> None:
        self._compiler = compiler
        self._eos_row = None

    # -- slots --------------------------------------------------------------------------------
    def setup_slot(self, slot: int, spec: SamplingSpec, outputs: Sequence[int]) -> None:
        """The slot's request starts (or resumes with `outputs` already generated)."""
        self.release_slot(slot)
        if spec.grammar is not None:
            if self.compiler is None:
                raise ValueError("structured outputs need the model's tokenizer")
            matcher = self.compiler.matcher(spec.grammar)
            for token in outputs:
                matcher.consume_token(int(token))
            self._matchers[slot] = matcher
            self.grammar[slot] = True
        if spec.logit_bias:
            ids = np.array([t for t, _ in spec.logit_bias], dtype=np.int64)
            values = np.array([b for _, b in spec.logit_bias], dtype=np.float32)
            self._bias[slot] = (ids, values)
            self.biased[slot] = True
        self.num_active += int(self.grammar[slot] or self.biased[slot])

    def release_slot(self, slot: int) -> None:
        self.num_active -= int(self.grammar[slot] or self.biased[slot])
        self._matchers[slot] = None
        self._bias[slot] = None
        self.grammar[slot] = self.biased[slot] = False

    def matcher(self, slot: int) -> llguidance.LLMatcher | None:
        return self._matchers[slot]

    def commit(self, slot: int, token_ids: Sequence[int]) -> None:
        """The slot's request committed `token_ids`: its matcher consumes them. A token the
        grammar refuses (none can be emitted) leaves the matcher in its error state, whose mask
        only ends the output."""
        matcher = self._matchers[slot]
        if matcher is None:
            return
        for token in token_ids:
            if not matcher.consume_token(int(token)):
                break

    # -- rounds -------------------------------------------------------------------------------
    def round_constraints(
        self, batch: RaggedBatch, input_ids: np.ndarray
    ) -> RoundConstraints | None:
        """The constraints of the round's logit rows (None when no row has any). `input_ids`
        [R] holds the drafts at their rows."""
        if not self.num_active:
            return None
        slots, n = batch.requests.slots, batch.requests.num_decode
        group_rows = batch.group_rows
        # per constrained request: its first logit row and how many rows it has there
        num_sampling = len(batch.sample_of)
        req = np.concatenate([np.arange(n), batch.sample_of]).astype(np.int64)
        first = np.concatenate(
            [group_rows[:n], batch.num_dec_rows + np.arange(num_sampling)]
        ).astype(np.int64)
        num = np.concatenate(
            [np.diff(group_rows[: n + 1]), np.ones(num_sampling, dtype=np.int64)]
        ).astype(np.int64)
        req_slots = slots[req]
        masked = np.flatnonzero(self.grammar[req_slots])
        biased = np.flatnonzero(self.biased[req_slots])
        if not len(masked) and not len(biased):
            return None
        mask_rows, bitmask = self._masks(req_slots[masked], first[masked], num[masked], input_ids)
        bias_rows, bias_ids, bias_values = self._bias_entries(
            req_slots[biased], first[biased], num[biased]
        )
        return RoundConstraints(mask_rows, bitmask, bias_rows, bias_ids, bias_values)

    def _masks(
        self, slots: np.ndarray, first: np.ndarray, num: np.ndarray, input_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(mask_rows [G], bitmask [G, W]) of the grammar requests' logit rows; a group's
        row j is masked by the state after its drafts 1..j (input rows first+1 .. first+j)."""
        width = -(-self.vocab_size // 32)
        if not len(slots):
            return np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(num)]).astype(np.int64)  # [g + 1]
        mask_rows = np.repeat(first - starts[:-1], num) + np.arange(int(starts[-1]))
        bitmask = np.empty((int(starts[-1]), width), dtype=np.int32)
        bitmask[:] = self._eos_mask()
        plain, drafted = [], []
        for slot, row, offset, k in zip(
            slots.tolist(), first.tolist(), starts[:-1].tolist(), num.tolist()
        ):
            matcher = self._matchers[slot]
            if k == 1:
                plain.append((matcher, offset))
            else:  # the rows of a decode group are its logit rows; drafts follow its first
                drafted.append((matcher, offset, input_ids[row + 1 : row + k].tolist()))
        self.compiler.fill_masks(plain, drafted, bitmask)
        return mask_rows, bitmask

    def _bias_entries(
        self, slots: np.ndarray, first: np.ndarray, num: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (logit row, token, bias) of the biased requests' rows."""
        rows, ids, values = [], [], []
        for slot, row, k in zip(slots.tolist(), first.tolist(), num.tolist()):
            tok, val = self._bias[slot]
            rows.append(np.repeat(np.arange(row, row + k), len(tok)))
            ids.append(np.tile(tok, k))
            values.append(np.tile(val, k))
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0, dtype=np.float32)
        return np.concatenate(rows), np.concatenate(ids), np.concatenate(values)

    def _eos_mask(self) -> np.ndarray:
        """[W] int32: the mask that only lets the output end."""
        if self._eos_row is None:
            row = np.zeros(-(-self.vocab_size // 32), dtype=np.uint32)
            for t in self.compiler.eos_token_ids:
                row[t // 32] |= np.uint32(1 << (t % 32))
            self._eos_row = row.view(np.int32)
        return self._eos_row

    def upload(self, rc: RoundConstraints) -> DeviceConstraints:
        """One host -> device copy of the round's constraints."""
        buf = self._host
        buf.start()
        has_mask, has_bias = len(rc.mask_rows) > 0, len(rc.bias_rows) > 0
        if has_mask:
            buf.add("mask_rows", rc.mask_rows, np.int64)
            buf.add("bitmask", rc.bitmask, np.int32)
        if has_bias:
            buf.add("bias_rows", rc.bias_rows, np.int64)
            buf.add("bias_ids", rc.bias_ids, np.int64)
            buf.add("bias_values", rc.bias_values, np.float32)
        dev = buf.upload()
        return DeviceConstraints(
            mask_rows=dev.get("mask_rows"),
            bitmask=dev.get("bitmask"),
            bias_rows=dev.get("bias_rows"),
            bias_ids=dev.get("bias_ids"),
            bias_values=dev.get("bias_values"),
        )
