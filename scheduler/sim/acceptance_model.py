"""The simulator's acceptance model (format of the shared `acceptance.json`).

Each request draws a class by weight. Within a request a two-state Markov chain (easy/hard)
moves once per generated token; a drafted token is accepted with the probability of the state
at its position, and a chain stops at its first rejection.

The chain and the acceptance draws are fixed per request and *per output position* (from the
seed and the request id), so every policy faces exactly the same sequence of easy and hard
stretches and the same lucky or unlucky draws (common random numbers): differences between
policies come from their decisions alone. A draft at output position t is accepted iff
`u[t] < p(state[t])`; a chain of d drafts starting at position t accepts
`min(d, run[t])` where `run[t]` counts consecutive acceptable positions from t.

The oracle sees the state at the next position (not the draws) and gets the exact survival
`s_j = P(positions t..t+j-1 all accepted | state[t])` from the chain's transition law.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EASY, HARD = 0, 1


@dataclass(frozen=True)
class AcceptanceClass:
    weight: float
    easy: float
    hard: float
    p_easy_to_hard: float
    p_hard_to_easy: float

    @property
    def stationary_easy(self) -> float:
        total = self.p_easy_to_hard + self.p_hard_to_easy
        return self.p_hard_to_easy / total if total > 0 else 1.0

    @property
    def mean_acceptance(self) -> float:
        pi = self.stationary_easy
        return pi * self.easy + (1 - pi) * self.hard


def load_cohorts(path: str | Path) -> dict[str, tuple[AcceptanceClass, ...]]:
    with open(path) as f:
        data = json.load(f)
    return {
        name: tuple(AcceptanceClass(**c) for c in classes)
        for name, classes in data["cohorts"].items()
    }


class _RequestPath:
    """One request's hidden states and acceptance run lengths over its output positions."""

    __slots__ = ("cls", "run", "state")

    def __init__(self, cls: AcceptanceClass, rng: np.random.Generator, length: int):
        self.cls = cls
        state = EASY if rng.random() < cls.stationary_easy else HARD
        # Alternate geometric holding times (a switch after each token w.p. p_leave).
        states = np.empty(length, dtype=np.int8)  # [length]
        pos = 0
        while pos < length:
            p_leave = cls.p_easy_to_hard if state == EASY else cls.p_hard_to_easy
            hold = int(rng.geometric(p_leave)) if p_leave > 0 else length
            states[pos : pos + hold] = state
            pos += hold
            state = 1 - state
        p = np.where(states == EASY, cls.easy, cls.hard)  # [length]
        ok = rng.random(length) < p  # [length]
        # run[t] = consecutive acceptable positions from t: next rejection index - t
        idx = np.arange(length)
        next_reject = np.where(~ok, idx, length)
        next_reject = np.minimum.accumulate(next_reject[::-1])[::-1]
        self.run = (next_reject - idx).tolist()  # Python ints: O(1) lookups per chain
        self.state = states


class AcceptanceState:
    """Hidden acceptance of the live requests, addressed by slot."""

    def __init__(self, classes: tuple[AcceptanceClass, ...], seed: int, max_len: int = 8192):
        self.classes = classes
        self.seed = seed
        self.max_len = max_len
        weights = np.array([c.weight for c in classes])
        self._class_p = weights / weights.sum()
        self._paths: dict[int, _RequestPath] = {}
        self._slot_path: dict[int, _RequestPath] = {}

    def mean_acceptance(self) -> float:
        return float(sum(p * c.mean_acceptance for p, c in zip(self._class_p, self.classes)))

    def path(self, req_id: int) -> _RequestPath:
        path = self._paths.get(req_id)
        if path is None:
            rng = np.random.default_rng([self.seed, req_id])
            cls = self.classes[int(rng.choice(len(self.classes), p=self._class_p))]
            path = _RequestPath(cls, rng, self.max_len)
            self._paths[req_id] = path
        return path

    def enter(self, slot: int, req_id: int) -> None:
        self._slot_path[slot] = self.path(req_id)

    def leave(self, slot: int) -> None:
        self._slot_path.pop(slot, None)

    def accepted(self, slot: int, position: int, num_draft: int) -> int:
        """Accepted prefix of a chain of `num_draft` drafts starting at output `position`."""
        run = self._slot_path[slot].run
        return min(num_draft, run[position]) if position < len(run) else 0

    def true_survival(
        self, slots: np.ndarray, positions: np.ndarray, max_drafts: int
    ) -> np.ndarray:
        """[n, max_drafts] exact P(drafts 1..j accepted) given the state at each next position."""
        n = len(slots)
        p_acc = np.empty((n, 2))  # [n, state]
        p_sw = np.empty((n, 2))  # [n, state] P(leave the state) per token
        belief = np.zeros((n, 2))  # [n, state] P(state, all accepted so far)
        for i, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
            path = self._slot_path[slot]
            c = path.cls
            p_acc[i] = (c.easy, c.hard)
            p_sw[i] = (c.p_easy_to_hard, c.p_hard_to_easy)
            belief[i, path.state[min(pos, len(path.state) - 1)]] = 1.0
        out = np.empty((n, max_drafts))
        for j in range(max_drafts):
            belief = belief * p_acc
            out[:, j] = belief.sum(1)
            move = belief * p_sw
            belief = belief - move + move[:, ::-1]
        return out
