"""Per-request acceptance estimators, per draft position, with a prior from global statistics.

Notation: `a_j` is the probability that draft position j is accepted given that positions
1..j-1 were (chain semantics: drafting stops at the first rejection). A speculating request
with d drafts emits `1 + a_1 + a_1*a_2 + ... + a_1*...*a_d` tokens in expectation: the bonus or
correction token always, and position j only if all positions up to j survive. The planner
needs the survival products `s_j = a_1 * ... * a_j`.

Estimate (all counts are per slot and decay every round, so recent rounds dominate and a request
that has not speculated for a while drifts back to its prior and gets re-probed):

    global g_j      = accepted_j / observed_j over all requests (slow decay): the drafter's
                      own statistics, started from `prior_acceptance`
    request rate r  = (A + K_RATE * g) / (O + K_RATE)        A, O: the request's accepted and
                                                              observed positions, all positions
    position prior  = r * g_j / g                            global shape, request level
    a_j             = (A_j + K_POS * prior_j) / (O_j + K_POS)

An outcome (d drafted, m accepted) observes positions 1..min(m+1, d): 1..m accepted and, when
m < d, position m+1 rejected; later positions were never reached and are not observed.
"""

from __future__ import annotations

import numpy as np

# Constants (tuned on the simulator's two-state acceptance models, documented in
# docs/perf/scheduler.md): acceptance states persist a few rounds, so a per-round decay of 0.5
# keeps the last 2 rounds dominant; the pseudo-counts keep a single observed position from
# moving an estimate all the way to 0 or 1.
REQUEST_DECAY = 0.5
K_RATE = 2.0
K_POS = 2.0
GLOBAL_DECAY = 0.999
GLOBAL_PRIOR_COUNT = 20.0
MAX_ACCEPTANCE = 0.995


class AcceptanceEstimator:
    def __init__(
        self,
        num_slots: int,
        max_drafts: int,
        prior_acceptance: float = 0.7,
        request_decay: float = REQUEST_DECAY,
    ):
        self.max_drafts = max(max_drafts, 1)
        self.request_decay = request_decay
        shape = (num_slots, self.max_drafts)
        self._acc = np.zeros(shape)  # [num_slots, max_drafts] decayed accepted counts
        self._obs = np.zeros(shape)  # [num_slots, max_drafts] decayed observed counts
        self._g_acc = np.full(self.max_drafts, prior_acceptance * GLOBAL_PRIOR_COUNT)
        self._g_obs = np.full(self.max_drafts, GLOBAL_PRIOR_COUNT)
        self._positions = np.arange(self.max_drafts)  # [max_drafts]

    def reset(self, slot: int) -> None:
        """A new request entered the slot: it starts from the global prior."""
        self._acc[slot] = 0.0
        self._obs[slot] = 0.0

    def global_acceptance(self) -> np.ndarray:
        return self._g_acc / self._g_obs  # [max_drafts]

    def acceptance(self, slots: np.ndarray) -> np.ndarray:
        """Per-position acceptance a_j for the given slots: [len(slots), max_drafts]."""
        g = self._g_acc / self._g_obs  # [max_drafts]
        g_pooled = self._g_acc.sum() / self._g_obs.sum()
        acc = self._acc[slots]  # [n, max_drafts]
        obs = self._obs[slots]
        rate = (acc.sum(1) + K_RATE * g_pooled) / (obs.sum(1) + K_RATE)  # [n]
        prior = np.minimum(rate[:, None] * (g / g_pooled)[None, :], MAX_ACCEPTANCE)
        return np.minimum((acc + K_POS * prior) / (obs + K_POS), MAX_ACCEPTANCE)

    def survival(self, slots: np.ndarray) -> np.ndarray:
        """s_j = a_1 * ... * a_j: [len(slots), max_drafts]."""
        return np.cumprod(self.acceptance(slots), axis=1)

    def decay(self) -> None:
        """Called once per round."""
        self._acc *= self.request_decay
        self._obs *= self.request_decay

    def observe(self, slots: np.ndarray, num_drafted: np.ndarray, num_accepted: np.ndarray):
        """Chain outcomes of one round for the given slots (arrays of equal length)."""
        if len(slots) == 0:
            return
        accepted = self._positions[None, :] < num_accepted[:, None]  # [n, max_drafts]
        observed = self._positions[None, :] < np.minimum(num_accepted + 1, num_drafted)[:, None]
        self._acc[slots] += accepted
        self._obs[slots] += observed
        self._g_acc = self._g_acc * GLOBAL_DECAY + accepted.sum(0)
        self._g_obs = self._g_obs * GLOBAL_DECAY + observed.sum(0)
