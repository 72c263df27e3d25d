"""Plain per-row float64 implementations of the sampling math, written from the definitions."""

from __future__ import annotations

import math

import numpy as np

from scheduler.plan import SamplingSpec


def penalise(
    logits: list[float], spec: SamplingSpec, output_counts: list[int], in_prompt: list[bool]
) -> list[float]:
    out = []
    for v, logit in enumerate(logits):
        if in_prompt[v] or output_counts[v] > 0:
            r = spec.repetition_penalty
            logit = logit / r if logit > 0 else logit * r
        logit -= spec.frequency_penalty * output_counts[v]
        logit -= spec.presence_penalty * (1.0 if output_counts[v] > 0 else 0.0)
        out.append(logit)
    return out


def distribution(logits: list[float], spec: SamplingSpec) -> np.ndarray:
    """temperature -> top-k -> top-p (after top-k) -> min-p -> normalise."""
    x = np.asarray(logits, dtype=np.float64)
    vocab = len(x)
    if spec.greedy:
        p = np.zeros(vocab)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / spec.temperature
    order = sorted(range(vocab), key=lambda v: -x[v])
    keep = set(order[: spec.top_k] if spec.top_k > 0 else order)
    w = np.array([math.exp(x[v] - x[order[0]]) if v in keep else 0.0 for v in range(vocab)])
    p = w / w.sum()
    if spec.top_p < 1.0:
        mass = 0.0
        kept = set()
        for v in order:
            if v not in keep:
                continue
            if mass >= spec.top_p:
                break
            kept.add(v)
            mass += p[v]
        keep = kept
    p = np.array([p[v] if v in keep else 0.0 for v in range(vocab)])
    p = p / p.sum()
    if spec.min_p > 0:
        p = np.where(p >= spec.min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def chi_square_limit(df: int, z: float = 4.75) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (z = 4.75: p ~ 1e-6), by the
    Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
