"""Per-slot sampling state of the round executor: the base seed and, for requests with
presence / frequency / repetition penalties, per-slot tables of output-token counts and prompt
tokens on the device (allocated on first use: [max_slots, vocab] each)."""

from __future__ import annotations

import torch

from executor import sampling
from scheduler.plan import SamplingSpec


class RowSampler:
    def __init__(self, vocab_size: int, device: torch.device, base_seed: int, max_slots: int):
        self.vocab_size = vocab_size
        self.device = device
        self.base_seed = base_seed
        self.max_slots = max_slots
        self.counts: torch.Tensor | None = None  # [max_slots, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [max_slots, vocab] bool
        self.penalised: set[int] = set()  # slots whose request uses penalties

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            shape = (self.max_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.counts, self.prompt_mask

    def _ids(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor([token_ids], dtype=torch.int64).to(self.device)  # [1, T]

    def setup_slot(
        self, slot: int, context: list[int], prompt_len: int, spec: SamplingSpec
    ) -> None:
        if not sampling.has_penalties(spec):
            self.penalised.discard(slot)
            return
        counts, mask = self._tables()
        slot_t = torch.tensor([slot], dtype=torch.int64, device=self.device)
        sampling.clear_slots(counts, slot_t)
        sampling.clear_slots(mask, slot_t)
        if prompt_len:
            sampling.mark_tokens(mask, slot_t, self._ids(context[:prompt_len]))
        if len(context) > prompt_len:  # resumed after preemption: outputs so far count
            sampling.update_output_counts(counts, slot_t, self._ids(context[prompt_len:]))
        self.penalised.add(slot)

    def release_slot(self, slot: int) -> None:
        self.penalised.discard(slot)

    def commit(self, slot: int, token_ids: list[int]) -> None:
        if slot in self.penalised and token_ids:
            slot_t = torch.tensor([slot], dtype=torch.int64, device=self.device)
            sampling.update_output_counts(self.counts, slot_t, self._ids(token_ids))

    def penalize(
        self,
        logits: torch.Tensor,
        st: sampling.SamplingTensors,
        row_slots: list[int],
        preceding: list[list[int]],
    ) -> torch.Tensor:
        """logits [L, V] -> penalised logits [L, V]; rows of a speculative group count the
        drafts before them as output (they would be, if accepted)."""
        if not st.use_penalties:
            return logits
        counts, mask = self._tables()
        slots_t = torch.tensor(row_slots, dtype=torch.int64).to(self.device)
        width = max((len(p) for p in preceding), default=0)
        pre = None
        if width:
            padded = [p + [-1] * (width - len(p)) for p in preceding]
            pre = torch.tensor(padded, dtype=torch.int64).to(self.device)  # [L, width]
        row_counts = sampling.gather_row_counts(counts, slots_t, pre)  # [L, V]
        row_mask = mask.index_select(0, slots_t)  # [L, V]
        return sampling.apply_penalties(logits, st, row_counts, row_mask)
