"""The acceptance model of speculative drafts (format of the shared `acceptance.json`), one
implementation for the simulator and for the benchmarks' synthetic drafter
(`executor/drafters/synthetic.py`).

Each request draws a class by weight. Within a request a two-state Markov chain (easy/hard)
moves once per generated token; a drafted token is accepted with the probability of the state
at its position, and a chain stops at its first rejection: a chain of d drafts standing for
generated tokens t .. t+d-1 accepts its longest prefix of acceptable positions.

A request's trace (its class, its states and its acceptance coin per generated token) comes
from its own random stream keyed by (seed, key, occurrence), so every policy faces the same
draws (common random numbers) and reading a trace ahead changes nothing. The synthetic drafter
keys a request by its prompt (`trace_key`); the simulator by its request id, or by keys a
caller gives (a benchmark's prompts, to replay the traces its run met). The simulator's
true-state policy gets the exact survival given a state (`true_survival`), clairvoyant the draws.
"""

from __future__ import annotations

import json
import zlib
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


TRACE_CHUNK = 64  # generated tokens drawn at a time when a trace runs out


def trace_key(token_ids) -> int:
    """The key a request's trace is drawn under: CRC-32 of its prompt's token ids as int64."""
    return zlib.crc32(np.asarray(token_ids, dtype=np.int64).tobytes())


class AcceptanceTrace:
    """One request's trace: `accepted[t]` says whether a draft standing for its t-th generated
    token would be accepted, `state[t]` that token's chain state. Drawn lazily in chunks of
    `TRACE_CHUNK` tokens, two coins per token (acceptance, then the switch to the next state),
    so a trace does not depend on how far it was read."""

    __slots__ = ("_easy", "accepted", "cls", "rng", "state")

    def __init__(
        self,
        classes: tuple[AcceptanceClass, ...],
        class_p: np.ndarray,
        seed: int,
        key: int,
        occurrence: int = 0,
    ):
        rng = np.random.default_rng([seed, key, occurrence])
        self.cls = classes[int(rng.choice(len(classes), p=class_p))]
        self.rng = rng
        self._easy = rng.random() < self.cls.stationary_easy  # state of generated token 0
        self.accepted: list[bool] = []
        self.state: list[int] = []  # EASY / HARD per generated token

    def extend_to(self, num_tokens: int) -> None:
        c = self.cls
        while len(self.accepted) < num_tokens:
            coins = self.rng.random((TRACE_CHUNK, 2)).tolist()  # [chunk, (accept, switch)]
            for accept_u, switch_u in coins:
                easy = self._easy
                self.state.append(EASY if easy else HARD)
                self.accepted.append(accept_u < (c.easy if easy else c.hard))
                if switch_u < (c.p_easy_to_hard if easy else c.p_hard_to_easy):
                    self._easy = not easy

    def num_accepted(self, first_token: int, num_draft: int) -> int:
        """Accepted prefix of a chain of drafts for generated tokens first_token .. + num_draft."""
        self.extend_to(first_token + num_draft)
        accepted = self.accepted
        n = 0
        while n < num_draft and accepted[first_token + n]:
            n += 1
        return n

    def state_at(self, token: int) -> int:
        self.extend_to(token + 1)
        return self.state[token]


def class_weights(classes: tuple[AcceptanceClass, ...]) -> np.ndarray:
    """[num_classes] the probability of drawing each class."""
    weights = np.array([c.weight for c in classes], dtype=np.float64)
    return weights / weights.sum()


class AcceptanceState:
    """Hidden acceptance of the live requests, addressed by slot. A request's trace is keyed by
    `trace_keys[req_id]` where given (e.g. the benchmark's prompts, `trace_key`), else by its
    request id."""

    def __init__(
        self,
        classes: tuple[AcceptanceClass, ...],
        seed: int,
        trace_keys: tuple[int, ...] = (),
    ):
        self.classes = tuple(classes)
        self.seed = seed
        self.trace_keys = trace_keys
        self._class_p = class_weights(self.classes)
        self._paths: dict[int, AcceptanceTrace] = {}
        self._slot_path: dict[int, AcceptanceTrace] = {}

    def mean_acceptance(self) -> float:
        return float(sum(p * c.mean_acceptance for p, c in zip(self._class_p, self.classes)))

    def path(self, req_id: int) -> AcceptanceTrace:
        path = self._paths.get(req_id)
        if path is None:
            keys = self.trace_keys
            key = keys[req_id] if 0 <= req_id < len(keys) else req_id
            path = AcceptanceTrace(self.classes, self._class_p, self.seed, key)
            self._paths[req_id] = path
        return path

    def enter(self, slot: int, req_id: int) -> None:
        self._slot_path[slot] = self.path(req_id)

    def leave(self, slot: int) -> None:
        self._slot_path.pop(slot, None)

    def accepted(self, slot: int, position: int, num_draft: int) -> int:
        """Accepted prefix of a chain of `num_draft` drafts starting at output `position`."""
        return self._slot_path[slot].num_accepted(position, num_draft)

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
            belief[i, path.state_at(pos)] = 1.0
        out = np.empty((n, max_drafts))
        for j in range(max_drafts):
            belief = belief * p_acc
            out[:, j] = belief.sum(1)
            move = belief * p_sw
            belief = belief - move + move[:, ::-1]
        return out
