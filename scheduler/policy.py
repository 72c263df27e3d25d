"""Per-round speculation policies: given the decoding requests of a round, how many drafts each
one gets (0: AR). The scheduler owns lifecycle and KV; a policy only picks depths.

`AdaptivePolicy` is the product's policy (`--spec-mode adaptive`): survival probabilities from
the per-request acceptance estimators, the calibrated cost model, the depth planner (drafts
priced as in the decode round of the live batch, a drafter's catch-up spread over the
request's own SPEC rounds: scheduler/catchup_pricing.py), plus hysteresis and a minimum dwell
so a request near the boundary does not flip every round, and a probe while the estimators'
prior rests on little evidence. `AllSpecPolicy` (`--spec-mode spec`) and `AllARPolicy`
(`--spec-mode ar`) are the fixed modes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.catchup_pricing import (
    SpecStretches,
    catchup_share,
    deferred_catchups,
    full_catchup_ms,
    joint_catchup_ms,
)
from scheduler.cost_model import CostModel
from scheduler.depth_planner import FORCE_KEY, Catchup, plan_depths
from scheduler.policy_api import Decision, DecodeView

# Hysteresis: while a request speculates its draft positions are valued at survival x
# (1 + HYSTERESIS), so leaving speculation needs a 3% worse estimate than break-even: enough
# to absorb estimates that move by a few per cent from round to round, small against the gap
# between a drafter's easy and hard stretches of text. One-sided: the way back in has its own
# hysteresis, the drafter's catch-up on the tokens it missed, and a penalty on top would keep
# requests that sit in AR there for good (their catch-up plus the penalty never pays).
HYSTERESIS = 0.03
# Minimum dwell: after a switch a request keeps its new mode for this many rounds, so that
# switching to speculation yields at least one observation before it can be dropped again.
# Arrivals and departures lift the dwell: the plan is re-made at once on a new cohort.
MIN_DWELL_ROUNDS = 2
# Decisions between two checks of whether a probe could pay at all for a batch of the same
# size (AdaptivePolicy.probe_can_pay: one more search, so not every round while the evidence
# is stale).
PROBE_RECHECK_ROUNDS = 64
# A probe drafts as deep as its request's survival stays at or above this (at least 1 draft;
# from the configured prior of 0.7: 2). Probes of one first position tell the prior about first
# positions only, and on code-like text it is the deep positions that pay, so a batch probed
# one position at a time can stay in AR on a drafter that would pay; a lower threshold makes
# every probe deeper, and dearer where speculation does not pay (prose-like text).
PROBE_DEPTH_SURVIVAL = 0.5
# A request that has never drafted is probed once on its own (AdaptivePolicy.first_probe) when the
# probe, its catch-up included, costs at most this share of the batch time the request will
# take (its remaining tokens x the AR round / the batch size), and speculation could pay at all
# (probe_can_pay). The global probe asks only while the prior rests on little evidence, and on
# a mixed workload the prior learned from the requests before says nothing of the next one:
# without this rule a code-like request after prose-like ones is never tried. A larger share
# gains more on mixed text and costs prose-like text more.
PROBE_NEW_SHARE = 0.015
# Entry margin: a plan in which nobody speculated last round and whose entrants must catch their
# drafters up is taken only at a predicted gain of at least ENTRY_MARGIN x the entrants' share
# of the batch. Such an entry is priced with its catch-up spread over the SPEC rounds the
# request is expected to stay, and near break-even (prose-like text) a request stays only a
# round or two, so a small predicted gain does not pay the catch-up back. Entries without a
# catch-up (a model-free drafter) keep the plain break-even: a margin on every entry costs
# where entering is cheap.
ENTRY_MARGIN = 0.05
# Yield calibration (YieldTracker): the discount of one speculating round's evidence (memory ~50
# rounds), of the evidence per decode round without speculation, the prior's weight in expected
# accepted drafts, and the bounds of the factor. The evidence outlives AR stretches (half-life
# ~350 decode rounds): relaxed faster, it is gone after the AR stretch between two entries and
# each entry is again made on the estimators' word alone; never relaxed, the evidence of one
# part of a cohort keeps another out (the code-like requests of a mixed cohort, held back by
# the prose-like ones').
YIELD_DISCOUNT = 0.98
YIELD_RELAX = 0.998
YIELD_PRIOR_DRAFTS = 50.0
YIELD_MIN, YIELD_MAX = 0.25, 1.5
# EMA weight of one round in the rate bar: ~20 rounds, enough to average the luck of single
# rounds, short enough to follow a change of regime (arrivals, drain) within a second or so.
RATE_ALPHA = 0.05


class RateTracker:
    """The long-run rate a draft position must pay for (the `rate_bar` of depth_planner).

    Kept as an uplift over the batch's all-AR rate: EMA(tokens emitted) / EMA(tokens all-AR
    would have emitted in the same measured time). Realized, so it carries the true acceptance
    of the requests (no selection bias from estimating only on speculated positions); relative
    to AR, so it follows the regime: a shrinking batch while draining or a prefill-heavy round
    has a lower AR rate and with it a lower bar. Starting at 1 (the AR rate), the bar climbs to
    the rate the policy actually achieves (Dinkelbach's iteration, one step per round).
    The scheduler feeds it decode-only rounds only: next to a prefill chunk drafts ride on an
    expensive eager forward almost for free, and the uplift of those rounds would hold the bar
    of the decode rounds after them above anything they can reach, keeping a full batch in AR.
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


class YieldTracker:
    """How many of the drafts the acceptance estimators expect accepted the speculating rounds
    actually got accepted, as (A + P) / (E + P): A and E the accepted and expected drafts of the
    recent speculating rounds (discounted sums), P a prior of YIELD_PRIOR_DRAFTS drafts at the
    estimators' word; within [YIELD_MIN, YIELD_MAX]. The adaptive policy scales the value of
    every draft position by it.

    The estimators learn each request's acceptance from its drafted positions, but the policy
    picks which requests draft by those very estimates: requests are chosen when their estimate
    is high, luck included, and then accept less than it said (the winner's curse). The
    realised yield is what the choice actually earns, so it corrects the estimates where the
    choice is made. Sums rather than a per-round average: a batch of one request, whose rounds
    expect 3 drafts and accept 0 or 7, moves the factor by its evidence only. While nobody
    speculates the evidence fades (YIELD_RELAX per decode round) and the factor returns to 1,
    so a cohort that changed is tried again on its estimators' word."""

    def __init__(self):
        self._expected = 0.0  # discounted sum of the drafts the estimators expected accepted
        self._accepted = 0.0  # discounted sum of the drafts accepted

    @property
    def factor(self) -> float:
        ratio = (self._accepted + YIELD_PRIOR_DRAFTS) / (self._expected + YIELD_PRIOR_DRAFTS)
        return min(max(ratio, YIELD_MIN), YIELD_MAX)

    def observe(self, expected: float, accepted: float) -> None:
        """One speculating round: the drafts its estimators expected accepted, and how many
        were."""
        if expected <= 0:
            return
        self._expected = YIELD_DISCOUNT * self._expected + expected
        self._accepted = YIELD_DISCOUNT * self._accepted + accepted

    def relax(self) -> None:
        """One decode round without drafts: the evidence fades."""
        self._expected *= YIELD_RELAX
        self._accepted *= YIELD_RELAX


@dataclass(frozen=True)
class PlanBasis:
    """The round the planner prices drafts against (see decode_basis)."""

    base_rows: int
    base_kv_tokens: int
    base_tokens: float
    num_prefill_rows: int
    rate_bar: float


def plan_in_basis(
    survival: np.ndarray,  # [n, D]
    key: np.ndarray,  # [n, D] ranking key
    view: DecodeView,
    catchup: Catchup,
    cost_model: CostModel,
    basis: PlanBasis,
):
    """plan_depths over the view's requests, priced in `basis`."""
    return plan_depths(
        survival,
        key,
        view.weights,
        catchup,
        cost_model,
        basis.base_rows,
        basis.base_kv_tokens,
        basis.base_tokens,
        basis.num_prefill_rows,
        basis.rate_bar,
        view.row_host_ms,
    )


def decode_basis(
    view: DecodeView, cost_model: CostModel, caught_up_share: float = 1.0
) -> PlanBasis:
    """Drafts are priced as in a decode-only round of the round's decoding requests, at the
    rate bar of the live batch.

    Next to a prefill chunk a draft rides on an eager forward of thousands of rows: its rows
    cost almost nothing, the round's own all-AR rate (the scheduler's bar: uplift x that
    rate) is a few tokens over tens of ms, and the drafter's catch-up on whole prompts,
    amortised against that round's gain, would look cheap; but the gain that pays a catch-up
    back is the one of the decode rounds that follow. So a round with prefill chunks is
    planned as its decode-only part would be. And while slots are still filling (live requests
    not decoding yet), a ms spent now delays the whole live batch: the bar is the uplift times
    the decode-only AR rate of all live requests.

    The uplift over AR is earned by requests whose drafter is caught up; requests that must
    catch up first cannot reach it before they have paid. So only the `caught_up_share` of
    the batch carries the uplift's excess over AR into the bar: a new wave of requests behind
    a first that speculated well is held to what it can reach, not locked out by the first
    wave's rate."""
    n = len(view.req_ids)
    num_live = max(view.num_live, n)
    plain = view.num_prefill_rows == 0 and num_live == n
    if plain and (caught_up_share >= 1.0 or view.rate_bar <= 0):
        return PlanBasis(view.base_rows, view.base_kv_tokens, view.base_tokens, 0, view.rate_bar)
    if plain:
        decode_kv, decode_tokens = view.base_kv_tokens, view.base_tokens
    else:
        # KV of the decoding requests: a first prefill chunk adds its own rows to
        # base_kv_tokens (a later chunk also its computed prefix: a slight over-estimate)
        decode_kv = max(view.base_kv_tokens - view.num_prefill_rows, n)
        decode_tokens = float(view.weights.sum())
    rate_bar = view.rate_bar
    if rate_bar > 0 and view.base_tokens > 0:
        round_ar_ms = cost_model.predict_ms_scalar(
            view.base_rows, view.base_kv_tokens, 0, 0, 0, view.num_prefill_rows
        )
        uplift = rate_bar * round_ar_ms / view.base_tokens
        uplift = 1.0 + max(uplift - 1.0, 0.0) * caught_up_share
        if plain:
            live_ar_ms = round_ar_ms
        else:
            live_ar_ms = cost_model.predict_ms_scalar(num_live, int(decode_kv * num_live / n))
        rate_bar = uplift * decode_tokens / n * num_live / live_ar_ms
    return PlanBasis(n if not plain else view.base_rows, decode_kv, decode_tokens, 0, rate_bar)


def entry_key(
    key: np.ndarray,  # [n, D] ranking key, changed in place
    value: np.ndarray,  # [n, D] survival as the planner values it
    catchup_ms: np.ndarray,  # [n] catch-up charge per round (joint_catchup_ms)
    basis: PlanBasis,
    cost_model: CostModel,
) -> None:
    """Ranks a lagging request's positions by what they are worth net of its catch-up.

    The planner takes positions in key order and keeps the best prefix. Ranked by survival
    alone, the first position of a request whose drafter must catch up would come as early as
    any other of the same survival, so a prefix could take a caught-up request's deeper
    positions only together with costly entries of others. So a lagging request is worth its
    best mean net value per position, max_d (s_1 + ... + s_d - catch-up in tokens at the bar)
    / d, and none of its positions ranks above that (they stay a prefix); one whose survival
    never pays its catch-up back is left out."""
    lagging = (catchup_ms > 0) & (key[:, 0] > 0) & (key[:, 0] < FORCE_KEY)
    if not lagging.any():
        return
    bar = basis.rate_bar
    if bar <= 0:
        ar_ms = cost_model.predict_ms_scalar(
            basis.base_rows, basis.base_kv_tokens, 0, 0, 0, basis.num_prefill_rows
        )
        bar = basis.base_tokens / ar_ms
    rows = np.flatnonzero(lagging)
    depth = np.arange(1, key.shape[1] + 1)  # [D]
    net = (np.cumsum(value[rows], axis=1) - (bar * catchup_ms[rows])[:, None]) / depth  # [r, D]
    key[rows] = np.minimum(key[rows], net.max(axis=1)[:, None])


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
        # whether a probe could change anything (see probe_can_pay), re-checked when the
        # batch size changes and every PROBE_RECHECK_ROUNDS decisions:
        # [decisions since the check, batch size, answer]
        self._probe_check = [0, -1, True]
        self.stretches = SpecStretches()
        # the request the last probe drafted for (-1: none), which the dwell does not hold
        self._probe_req_id = -1

    def survival(self, view: DecodeView, estimator: AcceptanceEstimator) -> np.ndarray:
        return estimator.survival(view.slots)[:, : view.max_drafts]

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        if n == 0 or view.max_drafts == 0 or not view.may_spec.any():
            return Decision(np.zeros(n, dtype=np.int64), "no request may speculate")
        survival = usable_survival(view, self.survival(view, estimator))  # [n, D]
        # Hysteresis (one-sided, see HYSTERESIS): a speculating request's positions are worth
        # survival x (1 + h) to the planner.
        # (the yield factor: what such estimates have been earning, see YieldTracker)
        factor = np.where(view.was_spec, 1.0 + self.hysteresis, 1.0) * view.yield_factor
        value = survival * factor[:, None]  # [n, D]
        usable = survival > 0
        key = np.where(usable, value, -1.0)
        # A probe is one observation for the prior, not a switch: the dwell does not hold its
        # request in speculation. (Held, its catch-up would look sunk, and the planner would
        # take the rest of a lagging batch into one shared catch-up behind it, each then held
        # by the dwell.)
        probed = view.req_ids == self._probe_req_id  # [n]
        hold = view.in_dwell & (not view.cohort_changed) & ~probed
        force = view.may_spec & (view.must_spec | (hold & view.was_spec)) & usable[:, 0]
        exclude = hold & ~view.was_spec & ~view.must_spec
        if view.num_prefill_rows:  # (a probe may still go: see deferred_catchups)
            key[deferred_catchups(view, cost_model.profile)] = -1.0
        needs_probe = self.wants_probe(estimator)
        may_probe = usable[:, 0] & ~exclude
        key[exclude] = -1.0
        key[force, 0] = FORCE_KEY
        full_catchup = full_catchup_ms(view, cost_model)
        # caught up: a catch-up no dearer than one drafter step over the batch (the few tokens
        # of a recent switch, not a prompt)
        one_step = float(cost_model.profile.draft_step_ms(np.array([n]))[0])
        caught_up = float(np.count_nonzero(full_catchup <= one_step)) / n
        basis = decode_basis(view, cost_model, caught_up)
        share = catchup_share(view, survival, self.stretches.expected_rounds(view))  # [n]
        catchup = Catchup(view.drafter_lag, share)
        if view.drafter_lag.any():
            charge = joint_catchup_ms(view, catchup.share, cost_model)  # [n]
            entry_key(key, value, charge, basis, cost_model)
        choice = plan_in_basis(value, key, view, catchup, cost_model, basis)
        if not choice.num_draft.any() and basis.rate_bar > 0 and view.was_spec.any():
            # Exits: a batch that speculated leaves only when no plan beats this round's own
            # AR rate. The bar is the realised rate of the last ~20 rounds; a batch that falls
            # below it (a lucky stretch behind it, a refill of harder requests) has nothing
            # better to spend the saved time on than its own rounds, and an AR round launched
            # ahead would keep the next ones AR (planned behind it, then held by the dwell)
            # until the bar has decayed, each at a fraction of the speculating rounds' rate.
            plain = replace(basis, rate_bar=0.0)
            choice = plan_in_basis(value, key, view, catchup, cost_model, plain)
        num_draft = choice.num_draft
        ar_rate = choice.ar_tokens / choice.ar_ms
        gain = (choice.predicted_tokens / choice.predicted_ms) / ar_rate - 1.0 if ar_rate else 0.0
        spec = num_draft > 0
        entry = spec.any() and not spec[view.was_spec | force].any()  # (see ENTRY_MARGIN)
        held = ""
        if entry and full_catchup[spec].sum() > 0 and gain < ENTRY_MARGIN * spec.mean():
            num_draft, held = np.zeros_like(num_draft), " entry below margin"
        probe = ""
        first = np.zeros(n, dtype=bool)
        if not num_draft.any() and not needs_probe and may_probe.any():
            first = may_probe & self.first_probe(view, survival, full_catchup, one_step, choice)
        if not num_draft.any() and (needs_probe or first.any()) and may_probe.any():
            check = self._probe_check
            check[0] += 1
            if check[0] >= PROBE_RECHECK_ROUNDS or check[1] != n:
                can_pay = self.probe_can_pay(view, estimator, cost_model, basis, catchup)
                check[:] = [0, n, can_pay]
            if check[2]:
                eligible = may_probe if needs_probe else first
                num_draft, probe = self.probe(view, eligible, survival), " probe"
                probe += "" if needs_probe else " (new request)"
                self._probe_req_id = int(view.req_ids[np.flatnonzero(num_draft)[0]])
        self.stretches.observe(view, num_draft)
        num_spec = int(np.count_nonzero(num_draft))
        reason = (
            f"k={num_spec}/{n} d_max={int(num_draft.max(initial=0))} "
            f"pred {gain * 100:+.1f}% tok/s vs AR ({choice.ar_ms:.2f} ms)"
            + held
            + probe
            + (" drain" if view.draining else "")
            + (" cohort-change" if view.cohort_changed else "")
        )
        return Decision(num_draft, reason, probe=bool(probe))

    def following_pays(
        self, view, estimator, cost_model, follow_ms: float, num_tokens: float
    ) -> bool:
        """Whether the drafter following the prompts that start now pays
        (`drafter_follows_prefill` auto): the speculation the planner would choose on this
        batch were every drafter caught up (no lag, hysteresis or dwell) saves more batch time
        over the `num_tokens` those prompts' requests will generate than the drafter's forward
        over the prompts costs (`follow_ms`). Each token of a batch costs 1 / its rate of the
        batch's time, so speculating saves num_tokens x (1 / AR rate - 1 / speculating rate).
        Whether it would speculate at all is not enough: a drafter that pays a launch-bound
        forward per followed round can cost more than all the speculation it enables saves.
        Changes no state."""
        n = len(view.req_ids)
        if n == 0 or view.max_drafts == 0 or not view.may_spec.any():
            return False
        survival = usable_survival(view, self.survival(view, estimator))  # [n, D]
        value = survival * view.yield_factor
        key = np.where(survival > 0, value, -1.0)
        caught_up = replace(view, drafter_lag=np.zeros_like(view.drafter_lag))
        catchup = Catchup(caught_up.drafter_lag, np.zeros(n))
        basis = decode_basis(caught_up, cost_model, 1.0)
        choice = plan_in_basis(value, key, caught_up, catchup, cost_model, basis)
        if not choice.num_draft.any() or choice.ar_tokens <= 0:
            return False
        ms_per_token_ar = choice.ar_ms / choice.ar_tokens
        ms_per_token_spec = choice.predicted_ms / choice.predicted_tokens
        return num_tokens * (ms_per_token_ar - ms_per_token_spec) > follow_ms

    def first_probe(self, view, survival, full_catchup, one_step: float, choice) -> np.ndarray:
        """[n] requests that have never drafted and whose probe is cheap against their life
        (see PROBE_NEW_SHARE): its catch-up and chain steps over the batch time the request's
        remaining tokens take, its share of the batch's AR rounds."""
        never = self.stretches.never_drafted(view)
        if not never.any():
            return never
        depth = np.maximum(np.count_nonzero(survival >= PROBE_DEPTH_SURVIVAL, axis=1), 1)
        probe_ms = full_catchup + depth * one_step  # [n]
        life_ms = view.num_remaining * choice.ar_ms / len(view.req_ids)  # [n]
        return never & (probe_ms <= PROBE_NEW_SHARE * life_ms)

    def wants_probe(self, estimator: AcceptanceEstimator) -> bool:
        return estimator.needs_probe()

    @staticmethod
    def probe_can_pay(view, estimator, cost_model, basis: PlanBasis, catchup: Catchup) -> bool:
        """Whether speculation would pay in this round if every request drafted at the best
        acceptance level of the estimator: if not even then, no probe outcome could change a
        decision (a compute-bound batch, a drafter too slow for it), and a probe's catch-up
        and chain would be spent for nothing."""
        top = estimator.survival_matrix()[-1, : view.max_drafts]  # [D]
        best = usable_survival(view, np.broadcast_to(top, (len(view.req_ids), len(top))))
        key = np.where(best > 0, best, -1.0)
        choice = plan_in_basis(best, key, view, catchup, cost_model, basis)
        return bool(choice.num_draft.any())

    @staticmethod
    def probe(
        view: DecodeView, eligible: np.ndarray, survival: np.ndarray | None = None
    ) -> np.ndarray:
        """[n] one draft for the eligible request whose drafter is the cheapest to catch up
        (least lag; the one with the most tokens left among equals), nothing if none is.

        Asked while the estimator's prior rests on too little recent evidence and the planner
        speculated nobody: the prior is learned from drafted positions only, so without a
        probe a drafter better than the prior would never be found out. The probe drafts as
        deep as the request's `survival` [n, D] stays at or above PROBE_DEPTH_SURVIVAL (one
        draft without it): one first position is the cheapest observation the prior learns from
        (its first positions), the deeper ones are what the per-position calibration learns
        from, and where chains tend to survive they are what speculation earns; the request's
        own belief then decides whether it goes on."""
        num_draft = np.zeros(len(view.req_ids), dtype=np.int64)
        candidates = np.flatnonzero(eligible)
        if len(candidates):
            lag = view.drafter_lag[candidates]
            best = candidates[np.lexsort((-view.num_remaining[candidates], lag))[0]]
            depth = 1
            if survival is not None:
                depth = max(1, int(np.count_nonzero(survival[best] >= PROBE_DEPTH_SURVIVAL)))
            num_draft[best] = depth
        return num_draft
