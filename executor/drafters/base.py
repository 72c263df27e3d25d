"""The drafter interface: propose draft tokens for a batch of speculating requests.

A drafter sees each slot's committed context (prompt + emitted tokens) and proposes `num_draft`
tokens that follow it. Drafters with a model of their own keep per-slot state (their KV length)
and catch up on tokens they missed while the request decoded plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class DraftRequest:
    slot: int
    # committed tokens (a read-only view of the executor's per-slot buffer); context[-1] is the
    # last token (its KV not yet written)
    context: Sequence[int]
    num_draft: int
    # The request's sampling temperature. Drafters that sample (draft-model) draw non-greedy
    # drafts at it; any draft distribution keeps rejection sampling exact, a matching
    # temperature only raises acceptance.
    temperature: float = 1.0


@dataclass
class DraftBatch:
    tokens: list[list[int]]  # per request, exactly num_draft tokens
    # [sum(num_draft), vocab] float32 draft probabilities in request order, for exact rejection
    # sampling; None for deterministic drafters (point-mass rule).
    probs: torch.Tensor | None = None
    catchup_ms: float = 0.0
    # Forced acceptance (synthetic drafter only): per request the accepted count to report.
    forced_accept: list[int] | None = None
    extra: dict = field(default_factory=dict)


class Drafter(Protocol):
    name: str
    has_probs: bool

    def setup(self, slot: int, context: list[int]) -> None: ...

    def release(self, slot: int) -> None: ...

    def propose(self, requests: list[DraftRequest], greedy: list[bool]) -> DraftBatch: ...

    def commit(self, slot: int, context: Sequence[int], num_accepted: int, num_draft: int) -> None:
        """Called after every round in which `slot` speculated. Tokens of AR and prefill rounds
        reach the drafter through `context` at its next proposal."""
