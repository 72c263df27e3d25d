"""Per-round speculation policies: given the decoding requests of a round, how many drafts each
one gets (0: AR). The scheduler owns lifecycle and KV; a policy only picks depths.

`AdaptivePolicy` is the product's policy (`--spec-mode adaptive`): survival probabilities from
the per-request acceptance estimators, the calibrated cost model, the depth planner, plus
hysteresis and a minimum dwell so a request near the boundary does not flip every round.
`AllSpecPolicy` (`--spec-mode spec`) and `AllARPolicy` (`--spec-mode ar`) are the fixed modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.cost_model import CostModel
from scheduler.depth_planner import FORCE_KEY, plan_depths

# Hysteresis: while a request speculates its draft positions are valued at survival x
# (1 + HYSTERESIS), so leaving speculation needs a 3% worse estimate than break-even: enough
# to absorb estimates that move by a few per cent from round to round, small against the gap
# between easy and hard states (0.93 vs 0.55 acceptance on code-like text). The way back in
# has a natural hysteresis already: the drafter's catch-up on the tokens it missed. A penalty
# on that side too kept most requests in AR at C = 128 in the simulator (incumbent AR plus
# catch-up never paid), so it is one-sided.
HYSTERESIS = 0.03
# Minimum dwell: after a switch a request keeps its new mode for this many rounds, so that
# switching to speculation yields at least one observation before it can be dropped again.
# Arrivals and departures lift the dwell: the plan is re-made at once on a new cohort.
MIN_DWELL_ROUNDS = 2
# Catch-up amortisation (see amortized_lag): once caught up, the drafter stays caught up while
# the request speculates, so the catch-up serves every round the request has left: its
# remaining tokens / TOKENS_PER_SPEC_ROUND, where 1.5 is about the lowest mean accepted length
# per speculating round in docs/perf/scheduler.md (prose-like text), capped at 512 rounds so
# that a very long request does not treat any catch-up as free. Shorter horizons locked
# requests out of speculation at C = 128..256 in the simulator (8 rounds on every cohort,
# 64 rounds on the mixed cohort): the one-off cost never paid within them.
TOKENS_PER_SPEC_ROUND = 1.5
CATCHUP_HORIZON_ROUNDS = 512.0
# EMA weight of one round in the rate bar: ~20 rounds, enough to average the luck of single
# rounds, short enough to follow a change of regime (arrivals, drain) within a second or so.
RATE_ALPHA = 0.05


@dataclass(frozen=True)
class DecodeView:
    """Everything a policy may look at for one round, as arrays over the decoding requests."""

    req_ids: np.ndarray  # [n]
    slots: np.ndarray  # [n] estimator rows
    num_remaining: np.ndarray  # [n] tokens each may still emit (max_tokens)
    drafter_lag: np.ndarray  # [n] tokens the drafter has not seen
    may_spec: np.ndarray  # [n] bool: drafter present and request allows it
    must_spec: np.ndarray  # [n] bool: request asked speculation "on"
    was_spec: np.ndarray  # [n] bool: speculated last round
    in_dwell: np.ndarray  # [n] bool: switched less than MIN_DWELL_ROUNDS rounds ago
    weights: np.ndarray  # [n] value of one token (1; less for short requests while draining)
    max_drafts: int  # spec_depth - 1
    base_rows: int  # n + prefill chunk rows
    base_kv_tokens: int
    base_tokens: float  # sum(weights) + prefill chunks that complete this round
    num_prefill_rows: int
    num_live: int
    cohort_changed: bool  # arrivals or departures since the last round
    draining: bool  # nothing waiting: finishing the live requests is what counts
    rate_bar: float = 0.0  # tokens per ms a draft position must pay for (0: per-round ratio)


@dataclass(frozen=True)
class Decision:
    num_draft: np.ndarray  # [n] int
    reason: str


class SpecPolicy(Protocol):
    name: str

    def decide(
        self, view: DecodeView, estimator: AcceptanceEstimator, cost_model: CostModel
    ) -> Decision: ...


class RateTracker:
    """The long-run rate a draft position must pay for (the `rate_bar` of depth_planner).

    Kept as an uplift over the batch's all-AR rate: EMA(tokens emitted) / EMA(tokens all-AR
    would have emitted in the same measured time). Realized, so it carries the true acceptance
    of the requests (no selection bias from estimating only on speculated positions); relative
    to AR, so it follows the regime: a shrinking batch while draining or a prefill-heavy round
    has a lower AR rate and with it a lower bar. Starting at 1 (the AR rate), the bar climbs to
    the rate the policy actually achieves (Dinkelbach's iteration, one step per round).
    The scheduler feeds it decode-only rounds only: next to a prefill chunk drafts ride on an
    expensive eager forward almost for free, and the uplift of those rounds (1.9x AR on the
    mixed cohort at C = 256 in the simulator) held the bar of the decode rounds after them far
    above anything they could reach, so a full batch stayed in AR.
    """

    def __init__(self, alpha: float = RATE_ALPHA):
        self.alpha = alpha
        self._tokens = 1.0
        self._ar_tokens = 1.0

    @property
    def uplift(self) -> float:
        # Never below 1: all-AR is always available, so the optimal long-run rate is at least
        # the AR rate; a lower bar would accept plans predicted to be worse than AR.
        return max(self._tokens / self._ar_tokens, 1.0)

    def observe(self, num_tokens: float, measured_ms: float, ar_rate: float) -> None:
        if measured_ms <= 0 or ar_rate <= 0:
            return
        a = self.alpha
        self._tokens += a * (num_tokens - self._tokens)
        self._ar_tokens += a * (measured_ms * ar_rate - self._ar_tokens)


def amortized_lag(view: DecodeView) -> np.ndarray:
    """[n] catch-up rows the planner charges to a request's first SPEC round.

    Catching the drafter up (after a prefill or AR rounds) is paid once and enables every
    later SPEC round of the request, so charging it all to one round would lock requests out
    of speculation exactly where a one-off cost is worth it. The planner spreads it over the
    rounds the request can still speculate: its remaining tokens at ~TOKENS_PER_SPEC_ROUND per
    round, at most CATCHUP_HORIZON_ROUNDS. (The predicted and measured round times keep the
    full catch-up.)"""
    horizon = np.clip(view.num_remaining / TOKENS_PER_SPEC_ROUND, 1.0, CATCHUP_HORIZON_ROUNDS)
    # Rounded to the nearest row, not up: rounding up charged every lagging request a whole
    # row per round, several times its share at the start of a request (a 128-token prompt
    # over ~340 rounds is 0.4 rows), which kept a batch of 256 in AR at its break-even.
    return np.rint(view.drafter_lag / horizon).astype(np.int64)


def depth_caps(view: DecodeView) -> np.ndarray:
    """[n] the most drafts each request can use: a chain never needs to run past max_tokens."""
    caps = np.minimum(view.num_remaining - 1, view.max_drafts)
    return np.where(view.may_spec, np.maximum(caps, 0), 0)


def usable_survival(view: DecodeView, survival: np.ndarray) -> np.ndarray:
    """Zeroes positions a request cannot use ([n, D])."""
    caps = depth_caps(view)
    return np.where(np.arange(view.max_drafts)[None, :] < caps[:, None], survival, 0.0)


class AllARPolicy:
    name = "all-ar"

    def decide(self, view, estimator, cost_model) -> Decision:
        return Decision(np.zeros(len(view.req_ids), dtype=np.int64), "spec-mode ar")


class AllSpecPolicy:
    name = "all-spec"

    def decide(self, view, estimator, cost_model) -> Decision:
        return Decision(depth_caps(view).astype(np.int64), "spec-mode spec: full depth")


class AdaptivePolicy:
    """Marginal-gain depth allocation on estimated survival, with hysteresis and dwell."""

    name = "adaptive"

    def __init__(self, hysteresis: float = HYSTERESIS, min_dwell_rounds: int = MIN_DWELL_ROUNDS):
        self.hysteresis = hysteresis
        self.min_dwell_rounds = min_dwell_rounds

    def survival(self, view: DecodeView, estimator: AcceptanceEstimator) -> np.ndarray:
        return estimator.survival(view.slots)[:, : view.max_drafts]

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        if n == 0 or view.max_drafts == 0 or not view.may_spec.any():
            return Decision(np.zeros(n, dtype=np.int64), "no request may speculate")
        survival = usable_survival(view, self.survival(view, estimator))  # [n, D]
        # Hysteresis (one-sided, see HYSTERESIS): a speculating request's positions are worth
        # survival x (1 + h) to the planner.
        factor = np.where(view.was_spec, 1.0 + self.hysteresis, 1.0)
        value = survival * factor[:, None]  # [n, D]
        usable = survival > 0
        key = np.where(usable, value, -1.0)
        hold = view.in_dwell & (not view.cohort_changed)
        force = view.may_spec & (view.must_spec | (hold & view.was_spec)) & usable[:, 0]
        exclude = hold & ~view.was_spec & ~view.must_spec
        key[exclude] = -1.0
        key[force, 0] = FORCE_KEY
        weights = view.weights
        choice = plan_depths(
            value,
            key,
            weights,
            amortized_lag(view),
            cost_model,
            view.base_rows,
            view.base_kv_tokens,
            view.base_tokens,
            view.num_prefill_rows,
            view.rate_bar,
        )
        num_spec = int(np.count_nonzero(choice.num_draft))
        ar_rate = choice.ar_tokens / choice.ar_ms
        gain = (choice.predicted_tokens / choice.predicted_ms) / ar_rate - 1.0 if ar_rate else 0.0
        reason = (
            f"k={num_spec}/{n} d_max={int(choice.num_draft.max(initial=0))} "
            f"pred {gain * 100:+.1f}% tok/s vs AR"
            + (" drain" if view.draining else "")
            + (" cohort-change" if view.cohort_changed else "")
        )
        return Decision(choice.num_draft, reason)
