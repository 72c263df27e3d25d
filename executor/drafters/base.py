"""The drafter interface: propose draft tokens for a batch of speculating requests.

A drafter sees each slot's committed context (prompt + emitted tokens) and proposes `num_draft`
tokens that follow it. Drafters with a model of their own keep per-slot state (their KV length)
and catch up on tokens they missed while the request decoded plainly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # A sampled request with a seed of its own: draft j is drawn with the noise of the target's
    # own draw of that token (`draw_keys`), so verification keeps the target's draws and the
    # output is the one plain decoding gives with that seed, whatever the route. None: the
    # drafter draws as it likes and rejection sampling verifies.
    seed: int | None = None

    def draw_keys(self) -> tuple[int, int] | None:
        """(seed, step of draft 1) for a coupled request: draft j's step is step + j - 1, the
        position of the token it drafts (the key of the target's draw there), else None."""
        return None if self.seed is None else (self.seed, len(self.context))


@dataclass
class DraftBatch:
    # per request, exactly num_draft tokens; None while a deferred proposal's drafts are still
    # on the device (`tokens_dev`), until `resolve`
    tokens: list[list[int]] | None
    # [sum(num_draft), vocab] float32 draft probabilities in request order, for exact rejection
    # sampling; None for deterministic drafters (point-mass rule).
    probs: torch.Tensor | None = None
    catchup_ms: float = 0.0
    # Forced acceptance (synthetic drafter only): per request the accepted count to report.
    forced_accept: list[int] | None = None
    extra: dict = field(default_factory=dict)
    # [sum(num_draft)] int64 on the device, the drafts in request order (drafters whose drafts
    # are made on the device): a deferred batch's consumer reads them there without waiting
    tokens_dev: torch.Tensor | None = None
    # fills `tokens`, `catchup_ms` and `extra` once the device is done (deferred batches only)
    resolver: Callable[[DraftBatch], None] | None = field(default=None, repr=False)

    def resolve(self) -> None:
        """Waits for a deferred proposal (no-op otherwise): afterwards `tokens` and the timings
        are on the host."""
        if self.resolver is not None:
            resolver, self.resolver = self.resolver, None
            resolver(self)


class Drafter(Protocol):
    name: str
    has_probs: bool

    def setup(self, slot: int, context: list[int]) -> None: ...

    def release(self, slot: int) -> None: ...

    def propose(
        self, requests: list[DraftRequest], greedy: list[bool], defer: bool = False
    ) -> DraftBatch:
        """Drafts for `requests`. With `defer`, a drafter working on the device may return
        before its drafts reach the host: `tokens` is then None and `tokens_dev` holds them
        until `DraftBatch.resolve`; without it, `tokens` is filled. Host drafters ignore it."""
        ...

    def commit(self, slot: int, context: Sequence[int], num_accepted: int, num_draft: int) -> None:
        """Called after every round in which `slot` speculated. Tokens of AR and prefill rounds
        reach the drafter through `context` at its next proposal."""
