"""Per-round sampling over the logit rows of a round (greedy, sampled, logprobs)."""

from __future__ import annotations

import torch


class RowSampler:
    def __init__(self, vocab_size: int, device: torch.device, base_seed: int = 0):
        self.vocab_size = vocab_size
        self.device = device
        self.base_seed = base_seed

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] -> [n] int64 (host copy made by the caller)."""
        return logits.argmax(dim=-1)
