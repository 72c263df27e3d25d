"""Drafts from draft logits on the device: the argmax for greedy rows, a draw from the tempered
softmax for sampled ones, with the distribution that exact rejection sampling needs; coupled
rows (a request with its own seed) draw with the noise of the target's own draw of the token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor.drafters.base import DraftRequest
from executor.rng import Stream, exponentials


@dataclass(frozen=True)
class DrawKeys:
    """Per request of a proposal, on the device: whether its drafts are coupled to the target's
    draws, its seed and the step (token position) of its first draft."""

    coupled: torch.Tensor  # [num_reqs] bool
    seed: torch.Tensor  # [num_reqs] int64
    first_step: torch.Tensor  # [num_reqs] int64

    @classmethod
    def of_requests(cls, requests: list[DraftRequest], device) -> DrawKeys | None:
        """None when no request is coupled (nothing to upload)."""
        keys = [r.draw_keys() for r in requests]
        if all(k is None for k in keys):
            return None
        table = np.array([k or (0, 0) for k in keys], dtype=np.int64)  # [num_reqs, 2]
        coupled = np.array([k is not None for k in keys])
        up = torch.from_numpy(table).to(device, non_blocking=True)
        return cls(torch.from_numpy(coupled).to(device, non_blocking=True), up[:, 0], up[:, 1])

    def rows(self, req: torch.Tensor, offset: torch.Tensor | int) -> dict:
        """pick_drafts' keyword arguments for rows of requests `req` [n] drafting the token
        `offset` places after each one's first draft."""
        return {
            "coupled": self.coupled[req],
            "seed": self.seed[req],
            "step": self.first_step[req] + offset,
        }


def pick_drafts(
    logits: torch.Tensor,  # [n, vocab] float32
    temp: torch.Tensor,  # [n] float32, 0 for greedy rows
    generator: torch.Generator,
    want_probs: bool,
    coupled: torch.Tensor | None = None,  # [n] bool: draw with the target's noise
    seed: torch.Tensor | None = None,  # [n] int64 the request's seed (coupled rows)
    step: torch.Tensor | None = None,  # [n] int64 position of the drafted token (coupled rows)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (tokens [n] int64, probs [n, vocab] or None). Sampled rows draw from
    q = softmax(logits / temperature) and report that q; greedy rows report the point mass of
    their argmax. No top-k/top-p: rejection sampling is exact for any q the drafts were really
    drawn from, so q only has to be honest. A coupled row's draw is the exponential race over
    q with the numbers the target's sampler uses for that token (`executor.rng`, keyed by
    (seed, step)): where q equals the target's distribution the draft is its draw exactly."""
    tokens = logits.argmax(dim=-1)  # [n]
    if not want_probs:
        return tokens, None
    sampled = temp > 0.0  # [n]
    q = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)  # [n, vocab]
    drawn = torch.multinomial(q, 1, generator=generator).squeeze(1)
    if coupled is not None:
        race = exponentials(seed, step, Stream.SAMPLE, q.shape[-1])  # [n, vocab]
        drawn = torch.where(coupled, (q / race).argmax(dim=-1), drawn)
    tokens = torch.where(sampled, drawn, tokens)
    point = torch.zeros_like(q).scatter_(1, tokens[:, None], 1.0)
    return tokens, torch.where(sampled[:, None], q, point)
