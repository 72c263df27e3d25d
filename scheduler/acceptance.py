"""Per-request acceptance estimators with a prior from the drafter's global statistics.

Notation: a speculating request with d drafts emits `1 + s_1 + ... + s_d` tokens in expectation,
where the survival `s_j` is the probability that draft positions 1..j are all accepted (chain
semantics: drafting stops at the first rejection). The planner needs s_j per request.
`AcceptanceEstimator` keeps a belief per request over a grid of acceptance levels (its doc
gives the model and the survival recursion), a global prior learned from all requests, and a
calibration of the survival per draft position; `AcceptanceKnowledge` is what of it carries
over to a new scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Acceptance levels of the grid: dense where decisions change (0.5 .. 0.95).
LEVELS = np.array([0.05, 0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.87, 0.93, 0.97])
# Per-token probability that a request's level is redrawn from the prior. Drafter quality on
# real text shifts over a few to a few tens of tokens; 0.08 is a mean stretch of ~12 tokens.
SWITCH = 0.08
# Weight of one observed request's belief in the global prior: a running mean over the first
# observations (PRIOR_COUNT pseudo-observations for the configured prior), then an EMA over the
# last ~50 observed request-rounds, so the prior follows a change of traffic.
PRIOR_ALPHA = 0.02
PRIOR_COUNT = 20.0
MAX_ACCEPTANCE = 0.995
# Calibration of the survival per draft position: realized / predicted survival over the
# positions actually drafted, each with the prediction of the request's belief when observed.
# The level model's one SWITCH rate cannot fit every text: it over-predicts the extra tokens of
# chains on text whose easy stretches are shorter than its ~12 tokens (prose-like) and
# under-predicts them where they are longer (code-like), enough to speculate at a loss on the
# one and to stay in AR on the other. Every drafted position is an unbiased sample of "position j
# accepted" against its predicted s_j (whether the chain survived so far or not), so the ratio
# carries no survival selection. CALIB_WINDOW: observations per position in the running sums
# (~a second of serving at C = 32); CALIB_PSEUDO: pseudo-observations at ratio 1, so a few
# chains do not move it; the factor stays within CALIB_RANGE.
CALIB_WINDOW = 400.0
CALIB_PSEUDO = 20.0
CALIB_RANGE = (0.5, 2.0)
# A probe's drafted positions (AdaptivePolicy.probe) count this many times in the calibration
# sums: a probe is made while the prior rests on little evidence, and its few positions are
# then the only ones; counted once, the pseudo-observations outweigh them, and a batch left in
# AR on the prior's deep positions stays there.
PROBE_CALIB_WEIGHT = 10.0
# Recent evidence: request-rounds observed, decayed per round by RECENT_DECAY (half-life ~700
# rounds, a few seconds of serving). While it is below PROBE_OBSERVATIONS the prior rests on
# little data (at start-up, or after a long stretch of AR), and a policy that only speculates
# where the prior says it pays could stay in AR for good on a drafter better than the prior
# (the configured 0.7 against ~0.8 first-position acceptance on code-like text): see
# AdaptivePolicy's probe.
RECENT_DECAY = 0.9995
PROBE_OBSERVATIONS = 6.0


@dataclass(frozen=True)
class AcceptanceKnowledge:
    """What an estimator learned about its drafter on the traffic it saw, apart from the
    requests themselves: the global prior over LEVELS, the evidence it rests on, and the
    calibration sums per draft position. A scheduler rebuilt for the same drafter and traffic
    (a benchmark's next run, a server whose load changed) adopts it and starts where the last
    one left off instead of at the configured prior, which it would otherwise have to probe
    its way out of again (`AcceptanceEstimator.adopt`). Torch-free, picklable."""

    prior: tuple[float, ...]  # [L]
    num_prior_obs: float
    num_recent_observations: float
    calib_pred: tuple[float, ...]  # [D]
    calib_real: tuple[float, ...]  # [D]


class AcceptanceEstimator:
    """Beliefs over acceptance levels, one per slot, and what they say about survival.

    How well a drafter does on a request changes along the text (code vs prose, boilerplate vs
    a tricky passage), and it persists for a while. Each request therefore carries a *belief*
    over a fixed grid of acceptance levels `a_l` (a discrete Bayesian filter):

        observe position with outcome x:  b_l <- b_l * (a_l if x else 1 - a_l), then normalised
        each generated token:             b <- (1 - SWITCH) * b + SWITCH * prior
                                          (the level may have changed to any other, as often
                                          as the global statistics say)

    `prior` is the drafter's global distribution over the levels: the running mean of the
    beliefs of all observed requests, started near the configured acceptance. A new request
    starts at the prior; a request that has not speculated for a while drifts back to it (and
    is re-probed when the prior says it pays).

    Survival follows from the same model, including the chance that the level changes inside
    the chain; a mixture of levels gives the right shape: having survived j-1 positions makes
    the high levels more likely, so a_j = s_j / s_{j-1} rises with j as real acceptance does:

        v = b;  for j = 1..D:  v_l <- v_l * a_l;  s_j = sum(v);
                               v <- (1 - SWITCH) * v + SWITCH * s_j * prior

    Each position j therefore has its own survival and conditional acceptance per request.
    The levels themselves get no global per-position correction: positions past the first are
    only observed on requests that survived, so such a factor would mostly learn that
    selection effect instead of a depth effect of the drafter. The calibration of the survival
    per position (CALIB_WINDOW) has no such bias: it compares every drafted position with the
    survival predicted for it."""

    def __init__(self, num_slots: int, max_drafts: int, prior_acceptance: float = 0.7):
        self.max_drafts = max(max_drafts, 1)
        self.levels = LEVELS  # [L]
        # Start flat but centred on prior_acceptance: weights fall off with distance.
        prior = np.exp(-(((LEVELS - prior_acceptance) / 0.3) ** 2))
        self.prior = prior / prior.sum()  # [L]
        self.belief = np.tile(self.prior, (num_slots, 1))  # [num_slots, L]
        self._num_prior_obs = PRIOR_COUNT
        self.num_recent_observations = 0.0
        self._survival_matrix: np.ndarray | None = None  # [L, D], cached per prior
        self._calibrated: np.ndarray | None = None  # [L, D] the same, calibrated
        # running sums per draft position of predicted and realized survival (calibration)
        self._calib_pred = np.full(self.max_drafts, CALIB_PSEUDO)  # [D]
        self._calib_real = np.full(self.max_drafts, CALIB_PSEUDO)  # [D]
        # The last survival() answer, kept while no belief changes: the policy and the
        # scheduler both ask for the same slots in one plan.
        self._version = 0
        self._last: tuple[np.ndarray, int, np.ndarray] | None = None

    def knowledge(self) -> AcceptanceKnowledge:
        """The global part of what this estimator learned (see AcceptanceKnowledge)."""
        return AcceptanceKnowledge(
            prior=tuple(float(v) for v in self.prior),
            num_prior_obs=float(self._num_prior_obs),
            num_recent_observations=float(self.num_recent_observations),
            calib_pred=tuple(float(v) for v in self._calib_pred),
            calib_real=tuple(float(v) for v in self._calib_real),
        )

    def adopt(self, known: AcceptanceKnowledge) -> None:
        """Starts from `known` instead of the configured prior: every slot's belief is reset to
        its prior, so call it before any request is admitted. Calibration sums of positions
        past this estimator's depth are dropped; positions `known` lacks keep their
        pseudo-observations. Raises ValueError on a prior of another grid or invalid numbers."""
        prior = np.asarray(known.prior, dtype=np.float64)
        pred = np.asarray(known.calib_pred, dtype=np.float64)
        real = np.asarray(known.calib_real, dtype=np.float64)
        if prior.shape != LEVELS.shape:
            raise ValueError(f"prior over {prior.size} levels, this estimator has {LEVELS.size}")
        if len(pred) != len(real) or not (pred > 0).all():
            raise ValueError("calibration sums of different lengths or a zero prediction")
        values = np.concatenate(([known.num_prior_obs, known.num_recent_observations], pred, real))
        if not (np.isfinite(values).all() and (values >= 0).all()):
            raise ValueError("acceptance knowledge holds negative or non-finite numbers")
        if not (np.isfinite(prior).all() and (prior >= 0).all() and prior.sum() > 0):
            raise ValueError("the prior must be non-negative with a positive sum")
        self.prior = prior if abs(prior.sum() - 1.0) < 1e-12 else prior / prior.sum()
        self.belief[:] = self.prior
        self._num_prior_obs = max(float(known.num_prior_obs), 1.0)
        self.num_recent_observations = float(known.num_recent_observations)
        d = min(len(pred), self.max_drafts)
        self._calib_pred[:d] = pred[:d]
        self._calib_real[:d] = real[:d]
        self._survival_matrix = None
        self._calibrated = None
        self._version += 1

    def needs_probe(self) -> bool:
        """The prior rests on too little recent evidence (see PROBE_OBSERVATIONS)."""
        return self.num_recent_observations < PROBE_OBSERVATIONS

    def reset(self, slot: int) -> None:
        """A new request entered the slot: it starts from the global prior."""
        self.belief[slot] = self.prior
        self._version += 1

    def global_acceptance(self) -> np.ndarray:
        """[D] prior acceptance per position (conditional on reaching it)."""
        s = self._survival(self.prior[None, :])[0]
        return s / np.concatenate(([1.0], s[:-1]))

    def request_rate(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots)] each request's expected acceptance of its next draft."""
        return np.minimum(self.belief[slots] @ self.levels, MAX_ACCEPTANCE)

    def _survival(self, belief: np.ndarray) -> np.ndarray:
        """[n, D] survival of each belief row: a linear map, belief @ survival_matrix."""
        return belief @ self.survival_matrix()

    def survival_matrix(self) -> np.ndarray:
        """[L, D] survival as a linear map of the belief. The recursion of the class doc is
        linear in v (s_j = sum(v) is), so the row of level l is the survival of a request known
        to be at level l, and any belief mixes the rows. Depends on the prior only: rebuilt
        after the prior moves (once per observed round), not per request."""
        if self._survival_matrix is None:
            keep = 1.0 - SWITCH
            levels = self.levels
            out = np.empty((len(levels), self.max_drafts))  # [L, D]
            # Backward form: m_1 = levels, m_j = levels * (keep * m_{j-1} + SWITCH * prior.m_{j-1})
            # gives column j for every start level at once (L-vector work per position).
            m = levels.copy()  # [L]
            out[:, 0] = m
            for j in range(1, self.max_drafts):
                m = levels * (keep * m + SWITCH * float(self.prior @ m))
                out[:, j] = m
            self._survival_matrix = out
        return self._survival_matrix

    def calibration(self) -> np.ndarray:
        """[D] realized / predicted survival per draft position (see CALIB_WINDOW)."""
        return np.clip(self._calib_real / self._calib_pred, *CALIB_RANGE)

    def calibrated_matrix(self) -> np.ndarray:
        """[L, D] survival_matrix with each position scaled by its calibration, kept at most 1
        and falling with depth per row (so every belief's survival does too)."""
        if self._calibrated is None:
            scaled = np.minimum(self.survival_matrix() * self.calibration()[None, :], 1.0)
            self._calibrated = np.minimum.accumulate(scaled, axis=1)
        return self._calibrated

    def survival(self, slots: np.ndarray) -> np.ndarray:
        """s_j = P(draft positions 1..j accepted), calibrated: [len(slots), max_drafts]
        (read-only)."""
        last = self._last
        if last is not None and last[0] is slots and last[1] == self._version:
            return last[2]
        out = self.belief[slots] @ self.calibrated_matrix()
        out.setflags(write=False)
        self._last = (slots, self._version, out)
        return out

    def decay(self) -> None:
        """Called once per round: every live request generated at least one token."""
        self._version += 1
        self.num_recent_observations *= RECENT_DECAY
        self.belief *= 1.0 - SWITCH
        self.belief += SWITCH * self.prior

    def observe(
        self,
        slots: np.ndarray,
        num_drafted: np.ndarray,
        num_accepted: np.ndarray,
        calib_weight: float = 1.0,
    ):
        """Chain outcomes of one round for the given slots (arrays of equal length)."""
        if len(slots) == 0:
            return
        self._version += 1
        b = self.belief[slots]  # [n, L]
        self._calibrate(b, num_drafted, num_accepted, calib_weight)
        # The global prior learns from first positions only: they are observed on every
        # speculating request, while deeper ones only on chains that survived so far. Fed with
        # whole chains, the prior would drift below the observed first-position acceptance,
        # enough to keep a large batch in AR at its break-even.
        first = b * np.where((num_accepted > 0)[:, None], self.levels, 1.0 - self.levels)
        first /= first.sum(1, keepdims=True)  # [n, L]
        num_observed = np.minimum(num_accepted + 1, num_drafted)  # [n]
        for j in range(int(num_observed.max())):
            rows = np.flatnonzero(num_observed > j)
            accepted = num_accepted[rows] > j  # [r]
            br = b[rows] * np.where(accepted[:, None], self.levels, 1.0 - self.levels)
            br /= br.sum(1, keepdims=True)
            b[rows] = (1.0 - SWITCH) * br + SWITCH * self.prior[None, :]
        self.belief[slots] = b
        self._num_prior_obs += len(slots)
        self.num_recent_observations += len(slots)
        alpha = min(max(PRIOR_ALPHA, 1.0 / self._num_prior_obs) * len(slots), 0.5)
        self.prior = (1.0 - alpha) * self.prior + alpha * first.mean(0)
        self.prior /= self.prior.sum()
        self._survival_matrix = None
        self._calibrated = None

    def _calibrate(
        self,
        belief: np.ndarray,
        num_drafted: np.ndarray,
        num_accepted: np.ndarray,
        weight: float = 1.0,
    ):
        """Adds one round's drafted positions to the calibration sums ([n, L] beliefs before
        the round's outcomes)."""
        d = self.max_drafts
        depth = np.arange(d)[None, :]  # [1, D]
        drafted = depth < num_drafted[:, None]  # [n, D]
        predicted = (belief @ self.survival_matrix()) * drafted  # [n, D] uncalibrated
        realized = (depth < num_accepted[:, None]) & drafted  # [n, D]
        keep = np.exp(-weight * drafted.sum(0) / CALIB_WINDOW)  # [D]
        self._calib_pred = self._calib_pred * keep + weight * predicted.sum(0)
        self._calib_real = self._calib_real * keep + weight * realized.sum(0)
        self._calibrated = None
