"""SYNTHETIC drafter, for benchmarks only: it fakes acceptance and drafts no real tokens.

It lets a benchmark run the real target and the real scheduler with the acceptance behaviour of a
drafter one does not have (e.g. a block drafter with published acceptance numbers), as an
acceptance profile describes it (`profiles/acceptance.json`, one list of classes per cohort).
Proposals are placeholder tokens; `DraftBatch.forced_accept` carries the accepted count and the
executor emits the *target's own* tokens with that length, so outputs stay the target's.
`SyntheticDrafter` describes the acceptance model and what the drafting costs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from executor.drafters.base import DraftBatch, Drafter, DraftRequest
from scheduler.sim.acceptance_model import (
    AcceptanceClass,
    AcceptanceTrace,
    class_weights,
    trace_key,
)


def load_cohort(path: str | Path, cohort: str) -> tuple[AcceptanceClass, ...]:
    profile = json.loads(Path(path).read_text())
    cohorts = profile.get("cohorts", {})
    if cohort not in cohorts:
        raise ValueError(
            f"acceptance profile {Path(path).name} has no cohort {cohort!r} "
            f"(has: {', '.join(sorted(cohorts))})"
        )
    classes = [
        AcceptanceClass(
            weight=float(c["weight"]),
            easy=float(c["easy"]),
            hard=float(c["hard"]),
            p_easy_to_hard=float(c["p_easy_to_hard"]),
            p_hard_to_easy=float(c["p_hard_to_easy"]),
        )
        for c in cohorts[cohort]
    ]
    if not classes or sum(c.weight for c in classes) <= 0:
        raise ValueError(f"cohort {cohort!r} has no class with a positive weight")
    return tuple(classes)


class SyntheticDrafter:
    """Acceptance from a cohort's classes:

    - each request draws a class by weight when it enters a slot;
    - within the request a two-state Markov chain (easy / hard) moves one step per generated
      token, from `easy` to `hard` with probability `p_easy_to_hard` and back with
      `p_hard_to_easy`; the first generated token's state is drawn from the chain's stationary
      distribution `pi_easy = p_hard_to_easy / (p_easy_to_hard + p_hard_to_easy)`;
    - a drafted position is accepted with the probability of the state of the token it stands
      for, and the chain of drafts stops at the first rejection.

    The state path and the acceptance coin of every generated token index are drawn once per
    request from its own random stream, keyed by (seed, the context it was set up with, how
    often that same context was set up before): the trace model of
    `scheduler/sim/acceptance_model.py`, which the simulator replays with the same keys. A
    request's acceptance trace therefore depends neither on how the policy splits it into AR
    and SPEC rounds nor on when it was admitted: policies are compared on the same traces.

    Cost: on its own the drafter costs nothing, which flatters speculation. Given a real drafter
    as `inner` (ngram, a draft model, a block drafter), every call is passed on to it as well
    (a block drafter's context write after every target forward too): its proposals are
    computed and thrown away, so each round pays the drafting and catch-up time that drafter
    would, while acceptance still comes from the profile. The inner drafter is told the
    synthetic accepted counts at commit, so its own state (a draft model's valid KV length,
    hence its catch-up rows) follows the same path as it would with those acceptances."""

    name = "synthetic"
    has_probs = False

    def __init__(
        self,
        acceptance_profile_path: str | Path,
        cohort: str,
        seed: int = 0,
        inner: Drafter | None = None,
    ):
        self.classes = load_cohort(acceptance_profile_path, cohort)
        self.cohort = cohort
        self.seed = seed
        self.inner = inner  # a real drafter run only for its cost (see the class doc)
        self._class_p = class_weights(self.classes)  # [num_classes]
        self._num_setups: dict[int, int] = {}  # context hash -> set-ups seen
        self._traces: dict[int, AcceptanceTrace] = {}  # slot -> trace
        self._base_len: dict[int, int] = {}  # slot -> context length at set-up

    @property
    def model(self):
        """The inner drafter's model, if it has one (the cost profiler times its chain steps)."""
        return getattr(self.inner, "model", None)

    def bind_block_tables(self, block_tables: np.ndarray) -> None:
        """The executor's block table, for an inner drafter that keeps paged KV of its own."""
        if hasattr(self.inner, "bind_block_tables"):
            self.inner.bind_block_tables(block_tables)

    # A block drafter inside reads the target's hidden states and writes its block past the
    # verified rows: the executor captures and the scheduler reserves for it as for the real one.
    @property
    def capture_layer_ids(self) -> tuple[int, ...] | None:
        return getattr(self.inner, "capture_layer_ids", None)

    @property
    def kv_lookahead(self) -> int:
        return int(getattr(self.inner, "kv_lookahead", 0))

    def extend_context(
        self,
        target_hidden: torch.Tensor,  # [rows, len(layer ids) * hidden]
        positions: torch.Tensor,  # [rows] int64
        slot_mapping: torch.Tensor,  # [rows] int64
    ) -> None:
        """The block drafter's context write after every target forward (a no-op without one:
        an engine set up for a block drafter runs other cost drafters in its place)."""
        if hasattr(self.inner, "extend_context"):
            self.inner.extend_context(target_hidden, positions, slot_mapping)

    def setup(self, slot: int, context: list[int]) -> None:
        if self.inner is not None:
            self.inner.setup(slot, context)
        key = trace_key(context)
        occurrence = self._num_setups.get(key, 0)
        self._num_setups[key] = occurrence + 1
        self._traces[slot] = AcceptanceTrace(
            self.classes, self._class_p, self.seed, key, occurrence
        )
        self._base_len[slot] = len(context)

    def release(self, slot: int) -> None:
        if self.inner is not None:
            self.inner.release(slot)
        self._traces.pop(slot, None)
        self._base_len.pop(slot, None)

    @property
    def follows_prefill(self) -> bool:
        """Whether the inner drafter can compute prefill chunks alongside the target."""
        return hasattr(self.inner, "follow_prefill")

    def follow_prefill(self, slots, starts, chunks) -> int:
        """The inner drafter's prefill following, for its cost (0 rows without one)."""
        if not self.follows_prefill:
            return 0
        return self.inner.follow_prefill(slots, starts, chunks)

    def propose(
        self, requests: list[DraftRequest], greedy: list[bool], defer: bool = False
    ) -> DraftBatch:
        # the inner drafter's work is the cost being modelled; its tokens are not used, so a
        # deferred inner proposal is never waited for before the round's forward
        paid = self.inner.propose(requests, greedy, defer) if self.inner is not None else None
        tokens, forced = [], []
        for r in requests:
            # drafts stand for the generated tokens at context positions len(context) ..
            first_token = len(r.context) - self._base_len[r.slot]
            forced.append(self._traces[r.slot].num_accepted(first_token, r.num_draft))
            tokens.append([r.context[-1]] * r.num_draft)  # placeholders, never compared
        batch = DraftBatch(tokens=tokens, forced_accept=forced)
        if paid is not None:

            def timings(b: DraftBatch) -> None:
                paid.resolve()
                b.catchup_ms, b.extra = paid.catchup_ms, paid.extra

            batch.resolver = timings
            if not defer:
                batch.resolve()
        return batch

    def commit(self, slot: int, context: list[int], num_accepted: int, num_draft: int) -> None:
        # The trace is indexed by generated token: nothing of it moves per round.
        if self.inner is not None:
            self.inner.commit(slot, context, num_accepted, num_draft)
