"""Acceptance outcomes of executed rounds that the estimator has not taken in yet.

`Scheduler.update` only records them; they are applied, in order, before anything reads the
estimator (a decision made ahead in the engine's overlap window, a fresh decision in `plan`, a
slot's reset at admission), which keeps the estimator's work off the host's critical path.
"""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.acceptance import AcceptanceEstimator


class AcceptanceOutcome(msgspec.Struct, frozen=True):
    """The chains of one round's live speculating requests."""

    slots: np.ndarray  # [m]
    num_drafted: np.ndarray  # [m]
    num_accepted: np.ndarray  # [m]
    weight: float  # calibration weight (a probe's outcomes weigh more)


class PendingOutcomes:
    def __init__(self, estimator: AcceptanceEstimator):
        self.estimator = estimator
        # oldest first; None: a round that only decays every belief
        self.rounds: list[AcceptanceOutcome | None] = []

    def add_round(self) -> None:
        """An executed round: every belief decays when it is applied."""
        self.rounds.append(None)

    def set_latest(self, outcome: AcceptanceOutcome) -> None:
        """The chains observed in the round added last."""
        self.rounds[-1] = outcome

    def flush(self) -> None:
        """Applies the recorded rounds to the estimator, in order."""
        if not self.rounds:
            return
        est = self.estimator
        for outcome in self.rounds:
            est.decay()
            if outcome is not None:
                est.observe(
                    outcome.slots, outcome.num_drafted, outcome.num_accepted, outcome.weight
                )
        self.rounds.clear()

    def reset_slot(self, slot: int) -> None:
        """A new request takes the slot: its predecessor's outcomes go in first, so they do
        not reach the new request's belief."""
        self.flush()
        self.estimator.reset(slot)
