"""The simulator's acceptance model (format of the shared `acceptance.json`).

Each request draws a class by weight. Within a request a two-state Markov chain (easy/hard)
moves once per generated token; a drafted position is accepted with the current state's
probability and a chain stops at its first rejection. The hidden state is what the oracle may
see: its survival curve is exact, `s_j = P(positions 1..j all accepted | state now)`.
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


class AcceptanceState:
    """Hidden per-slot acceptance state of the live requests, vectorised over slots."""

    def __init__(self, classes: tuple[AcceptanceClass, ...], num_slots: int, seed: int):
        self.classes = classes
        self.rng = np.random.default_rng(seed)
        weights = np.array([c.weight for c in classes])
        self._class_p = weights / weights.sum()
        self.p_accept = np.zeros((num_slots, 2))  # [slots, state] acceptance per state
        self.p_switch = np.zeros((num_slots, 2))  # [slots, state] P(leave this state)
        self.state = np.zeros(num_slots, dtype=np.int64)  # [slots] EASY or HARD
        self._saved: dict[int, tuple[int, int]] = {}  # req_id -> (class, state) across preemption

    def mean_acceptance(self) -> float:
        return float(sum(p * c.mean_acceptance for p, c in zip(self._class_p, self.classes)))

    def enter(self, slot: int, req_id: int) -> None:
        saved = self._saved.get(req_id)
        if saved is None:
            cls_idx = int(self.rng.choice(len(self.classes), p=self._class_p))
            state = EASY if self.rng.random() < self.classes[cls_idx].stationary_easy else HARD
        else:
            cls_idx, state = saved
        c = self.classes[cls_idx]
        self.p_accept[slot] = (c.easy, c.hard)
        self.p_switch[slot] = (c.p_easy_to_hard, c.p_hard_to_easy)
        self.state[slot] = state
        self._saved[req_id] = (cls_idx, state)

    def leave(self, slot: int, req_id: int) -> None:
        """Keeps the request's hidden state: a preempted request resumes where it was."""
        if req_id in self._saved:
            self._saved[req_id] = (self._saved[req_id][0], int(self.state[slot]))

    def step_tokens(self, slots: np.ndarray, num_tokens: np.ndarray) -> None:
        """Moves each slot's chain once per generated token."""
        remaining = num_tokens.copy()
        while True:
            active = remaining > 0
            if not active.any():
                return
            s = slots[active]
            flip = self.rng.random(len(s)) < self.p_switch[s, self.state[s]]
            self.state[s] ^= flip
            remaining[active] -= 1

    def run_chains(self, slots: np.ndarray, num_draft: np.ndarray) -> np.ndarray:
        """Accepted prefix length of each chain; moves the states over the emitted tokens
        (accepted drafts, then the correction or bonus token)."""
        n = len(slots)
        accepted = np.zeros(n, dtype=np.int64)
        alive = num_draft > 0
        for j in range(int(num_draft.max(initial=0))):
            alive &= num_draft > j
            if not alive.any():
                break
            s = slots[alive]
            ok = self.rng.random(len(s)) < self.p_accept[s, self.state[s]]
            idx = np.flatnonzero(alive)
            accepted[idx[ok]] += 1
            alive[idx[~ok]] = False
            # an accepted draft is a generated token: the chain moves
            s_ok = s[ok]
            flip = self.rng.random(len(s_ok)) < self.p_switch[s_ok, self.state[s_ok]]
            self.state[s_ok] ^= flip
        self.step_tokens(slots, np.ones(n, dtype=np.int64))  # correction / bonus token
        return accepted

    def true_survival(self, slots: np.ndarray, max_drafts: int) -> np.ndarray:
        """[n, max_drafts] exact P(positions 1..j accepted) from each slot's current state."""
        n = len(slots)
        belief = np.zeros((n, 2))  # [n, state] P(state, all accepted so far)
        belief[np.arange(n), self.state[slots]] = 1.0
        p_acc = self.p_accept[slots]  # [n, 2]
        p_sw = self.p_switch[slots]  # [n, 2]
        out = np.empty((n, max_drafts))
        for j in range(max_drafts):
            belief = belief * p_acc
            out[:, j] = belief.sum(1)
            stay = belief * (1 - p_sw)
            move = belief * p_sw
            belief = stay + move[:, ::-1]
        return out
