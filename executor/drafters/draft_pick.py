"""Drafts from draft logits on the device: the argmax for greedy rows, a draw from the tempered
softmax for sampled ones, with the distribution that exact rejection sampling needs."""

from __future__ import annotations

import torch


def pick_drafts(
    logits: torch.Tensor,  # [n, vocab] float32
    temp: torch.Tensor,  # [n] float32, 0 for greedy rows
    generator: torch.Generator,
    want_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (tokens [n] int64, probs [n, vocab] or None). Sampled rows draw from
    q = softmax(logits / temperature) and report that q; greedy rows report the point mass of
    their argmax. No top-k/top-p: rejection sampling is exact for any q the drafts were really
    drawn from, so q only has to be honest."""
    tokens = logits.argmax(dim=-1)  # [n]
    if not want_probs:
        return tokens, None
    sampled = temp > 0.0  # [n]
    q = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)  # [n, vocab]
    drawn = torch.multinomial(q, 1, generator=generator).squeeze(1)
    tokens = torch.where(sampled, drawn, tokens)
    point = torch.zeros_like(q).scatter_(1, tokens[:, None], 1.0)
    return tokens, torch.where(sampled[:, None], q, point)
