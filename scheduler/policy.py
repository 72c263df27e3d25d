"""Per-round speculation policies: given the decoding requests of a round, how many drafts each
one gets (0: AR). The scheduler owns lifecycle and KV; a policy only picks depths.

`AdaptivePolicy` is the product's policy (`--spec-mode adaptive`): survival probabilities from
the per-request acceptance estimators, the calibrated cost model, the depth planner (drafts
priced as in the decode round of the live batch, a drafter's catch-up spread over the
request's own SPEC rounds), plus hysteresis and a minimum dwell so a request near the boundary
does not flip every round, and a probe while the estimators' prior rests on little evidence.
`AllSpecPolicy` (`--spec-mode spec`) and `AllARPolicy` (`--spec-mode ar`) are the fixed modes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.cost_model import CostModel
from scheduler.depth_planner import FORCE_KEY, Catchup, plan_depths

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
# Catch-up amortisation (see amortized_catchup_ms): once caught up, the drafter stays caught
# up while the request speculates, so the catch-up serves every round the request has left:
# its remaining tokens over the tokens one of its SPEC rounds makes (1 + its survival sum),
# capped at 512 rounds so that a very long request does not treat any catch-up as free.
# (A fixed 1.5 tokens per round, the lowest mean accepted length on prose-like text, stretched
# the horizon of code-like requests ~3x, and they caught up on whole prompts that their few
# remaining SPEC rounds never paid back: per request, the refill throughput of code-like text
# at C = 64 went from 0.62x to 0.85x all-AR in the simulator, the round pricing already fixed.)
CATCHUP_HORIZON_ROUNDS = 512.0
# Decisions between two checks of whether a probe could pay at all for a batch of the same
# size (AdaptivePolicy.probe_can_pay: one more search, so not every round while the evidence
# is stale).
PROBE_RECHECK_ROUNDS = 64
# A probe drafts as deep as its request's survival stays at or above this (at least 1 draft;
# from the configured prior of 0.7: 2). Probes of one first position tell the prior about first
# positions only, and on code-like text it is the deep positions that pay: in the simulator
# (the H200 profile of 2026-11-30 10:19 UTC, 12 seeds) adaptive at code-like C = 16 never left
# AR in 4 of 12 runs with one-draft probes (0.927x the better fixed policy) and in 2 of 12 at
# 0.5 (0.948x); 0.4 did as well (0.954x) but put prose-like C = 16 at 0.978x in the one-seed
# check on the older measured profile (tests/scheduler/test_policy_check.py); 0.55 and 0.6 (one
# draft until a probe was accepted) stayed in AR in 5 and 6 of 12. Elsewhere at C = 1..16
# within +-0.5% but mixed C = 2 (1.087x -> 1.075x); refill at C = 64 0.2-0.4% lower (the
# fill's probes are deeper).
PROBE_DEPTH_SURVIVAL = 0.5
# A request that has never drafted is probed once on its own (AdaptivePolicy.first_probe) when the
# probe, its catch-up included, costs at most this share of the batch time the request will
# take (its remaining tokens x the AR round / the batch size), and speculation could pay at all
# (probe_can_pay). The global probe asks only while the prior rests on little evidence: on a
# mixed workload the prior learned from the requests before says nothing of the next one, and
# a code-like request after a prose-like one was never tried (H200, mixed at C = 1: after the
# first request's 23 speculating rounds every later request stayed in AR, 0.81x all-spec; with
# this rule, in a reduced H200 check, 1.125x). In the simulator (6 seeds, C = 1..32, two H200
# profiles): mixed text at C = 1..4 +1-6%, prose-like text at C = 1 -0.2-0.6%; 0.02 and 0.03
# gained up to 2% more on mixed C = 2..4 and cost prose-like C = 2..4 up to 0.8% more
# (docs/perf/scheduler.md).
PROBE_NEW_SHARE = 0.015
# Entry margin: a plan in which nobody speculated last round and whose entrants must catch their
# drafters up is taken only at a predicted gain of at least ENTRY_MARGIN x the entrants' share
# of the batch. Such an entry is priced with its catch-up spread over the SPEC rounds the
# request is expected to stay; on prose-like text it stayed one or two (H200, 2026-11-30 06:20
# UTC, prose C = 1: entries at +0.1% to +1.4% predicted, a 2.6-5.2 ms catch-up each, out again
# after two rounds). In the simulator (the profile of the H200 record of 08:41 UTC, 6 seeds,
# C = 1..32, three profile variants): points below 0.98 x the better fixed policy 9 -> 8,
# prose C = 2 0.985 -> 0.991, the mixed cohort's lead at C = 1..4 2-4% smaller (still
# 1.07-1.14x; docs/perf/scheduler.md). Entries without a catch-up (a model-free drafter) keep
# the plain break-even (as a margin on every entry, 0.05 took prose-like text at C = 32 with
# the n-gram drafter from 1.005 to 0.968).
ENTRY_MARGIN = 0.05
# Yield calibration (YieldTracker): the discount of one speculating round's evidence (memory ~50
# rounds), of the evidence per decode round without speculation, the prior's weight in expected
# accepted drafts, and the bounds of the factor. The evidence outlives AR stretches (half-life
# ~350 decode rounds): relaxed at 0.98 per round (half-life 35), it was gone after the AR
# stretch between two entries, and each entry was again made on the estimators' word. In the
# simulator (H200 profile of 2026-11-30 06:10 UTC, C = 1..32, code / prose / mixed, 3 seeds):
# 8 points below 0.98 x the better fixed policy at 0.98, 6 at 0.998 (prose C = 1, 2, 4: 0.973,
# 0.975, 0.974 -> 0.976, 0.988, 0.983), 7 with no relaxing at all (mixed C = 1: 1.093 -> 1.034,
# the cohort's code-like requests kept out by the prose-like ones' evidence).
YIELD_DISCOUNT = 0.98
YIELD_RELAX = 0.998
YIELD_PRIOR_DRAFTS = 50.0
YIELD_MIN, YIELD_MAX = 0.25, 1.5
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
    yield_factor: float = 1.0  # accepted drafts per draft the estimators expect accepted


@dataclass(frozen=True)
class Decision:
    num_draft: np.ndarray  # [n] int
    reason: str
    # a probe (AdaptivePolicy.probe): its outcomes weigh PROBE_CALIB_WEIGHT in the calibration
    probe: bool = False


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


class YieldTracker:
    """How many of the drafts the acceptance estimators expect accepted the speculating rounds
    actually got accepted, as (A + P) / (E + P): A and E the accepted and expected drafts of the
    recent speculating rounds (discounted sums), P a prior of YIELD_PRIOR_DRAFTS drafts at the
    estimators' word; within [YIELD_MIN, YIELD_MAX]. The adaptive policy scales the value of
    every draft position by it.

    The estimators learn each request's acceptance from its drafted positions, but the policy
    picks which requests draft by those very estimates: requests are chosen when their estimate
    is high, luck included, and then accept less than it said (the winner's curse). On the H200
    (prose-like text, C = 8) a batch speculated for 71 rounds at 0.73x the AR rate of its AR
    rounds, and prose-like requests accepted 0.45-0.69 of the drafts their estimates expected
    (`docs/perf/gpu.md`). The realised yield is what the choice actually earns, so it
    corrects the estimates where the choice is made. Sums rather than a per-round average: a
    batch of one request, whose rounds expect 3 drafts and accept 0 or 7, moves the factor by
    its evidence only. While nobody speculates the evidence fades (YIELD_RELAX per decode
    round) and the factor returns to 1, so a cohort that changed is tried again on its
    estimators' word."""

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


class SpecStretches:
    """How long each request keeps speculating once it has started: its own exit rate.

    A catch-up is paid back only by the SPEC rounds that follow it until the request leaves
    speculation, not by the request's whole remaining life: a request whose speculation rests
    on a lucky belief (prose-like text near break-even) drops back to AR after a round or two,
    and its drafter must catch up again on the next entry. In the simulator (2026-11-30 H200
    profile, prose at C = 1..2) entries priced over the request's life took 16-21% of
    request-rounds into speculation at 0.96x all-AR throughput. Each request's stretch is
    geometric in this estimate: (its SPEC rounds + 1) / (its exits + 1 / CATCHUP_HORIZON_ROUNDS),
    so a request that has not left speculation yet (a new one too) keeps the whole horizon,
    and one that left after two rounds expects about three. Per request, not per batch: on
    mixed text the prose-like requests' exits must not shorten the code-like ones' horizon."""

    def __init__(self):
        self._req_id = np.full(0, -1, dtype=np.int64)  # [slots] request the counts belong to
        self._spec_rounds = np.zeros(0)  # [slots]
        self._exits = np.zeros(0)  # [slots]

    def _rows(self, view: DecodeView) -> np.ndarray:
        slots = view.slots
        size = int(slots.max(initial=-1)) + 1
        if size > len(self._req_id):  # grow to the largest slot seen
            grow = size - len(self._req_id)
            self._req_id = np.concatenate([self._req_id, np.full(grow, -1, dtype=np.int64)])
            self._spec_rounds = np.concatenate([self._spec_rounds, np.zeros(grow)])
            self._exits = np.concatenate([self._exits, np.zeros(grow)])
        fresh = self._req_id[slots] != view.req_ids
        if fresh.any():  # a new request in the slot starts without history
            self._req_id[slots[fresh]] = view.req_ids[fresh]
            self._spec_rounds[slots[fresh]] = 0.0
            self._exits[slots[fresh]] = 0.0
        return slots

    def never_drafted(self, view: DecodeView) -> np.ndarray:
        """[n] requests that have not drafted yet (a probe counts as a SPEC round here)."""
        return self._spec_rounds[self._rows(view)] == 0

    def expected_rounds(self, view: DecodeView) -> np.ndarray:
        """[n] expected SPEC rounds of each request's next stretch."""
        rows = self._rows(view)
        return (self._spec_rounds[rows] + 1.0) / (self._exits[rows] + 1.0 / CATCHUP_HORIZON_ROUNDS)

    def observe(self, view: DecodeView, num_draft: np.ndarray) -> None:
        """One decision: requests that speculated last round and now do not have exited. (A
        decision made ahead and then remade counts twice; both counts scale alike.)"""
        rows = self._rows(view)
        self._spec_rounds[rows] += num_draft > 0
        self._exits[rows] += view.was_spec & (num_draft == 0)


def catchup_share(
    view: DecodeView, survival: np.ndarray, max_rounds: np.ndarray | float = CATCHUP_HORIZON_ROUNDS
) -> np.ndarray:
    """[n] the fraction of a request's drafter catch-up charged to one of its SPEC rounds.

    Catching the drafter up (after a prefill or AR rounds) is paid once and enables every
    later SPEC round of the request, so it is spread over the rounds the request can still
    speculate: its remaining tokens over the tokens one of its SPEC rounds makes at full
    usable depth (1 + sum of its survival), at most CATCHUP_HORIZON_ROUNDS. The charge is the
    catch-up's cost in ms / horizon whatever the shape of the step-time curve (spreading lag
    *rows* instead priced them where the curve is flat or on its tail depending on the
    batch). (The predicted and measured round times keep the full catch-up.)"""
    tokens_per_round = 1.0 + survival.sum(1)  # [n]
    horizon = np.minimum(view.num_remaining / tokens_per_round, max_rounds)  # [n]
    return 1.0 / np.clip(horizon, 1.0, CATCHUP_HORIZON_ROUNDS)


def amortized_catchup_ms(
    view: DecodeView, survival: np.ndarray, cost_model: CostModel
) -> np.ndarray:
    """[n] drafter catch-up ms charged to a request's SPEC round were it the only one to
    catch up (full_catchup_ms x catchup_share)."""
    full = full_catchup_ms(view, cost_model)
    if not full.any():
        return full
    return full * catchup_share(view, survival)


def joint_catchup_ms(view: DecodeView, share: np.ndarray, cost_model: CostModel) -> np.ndarray:
    """[n] drafter catch-up ms charged to a request's SPEC round when every lagging request
    catches up in it: the first step over all their lag rows less the plain step, split by
    lag rows (depth_planner.Catchup), times the request's share."""
    lag = view.drafter_lag
    total = int(lag.sum())
    if not total:
        return np.zeros(len(lag))
    n = len(lag)
    first_step = cost_model.profile.first_step_ms_scalar
    joint = max(first_step(n, total) - first_step(n, 0), 0.0)
    return joint * lag / total * share


def full_catchup_ms(view: DecodeView, cost_model: CostModel) -> np.ndarray:
    """[n] ms each request's lag adds to the chain's first step over the batch (0 without
    lag), as the cost model prices that step (one forward, or passes of a few rows each)."""
    lag = view.drafter_lag
    if not lag.any():
        return np.zeros(len(lag))
    first_step = cost_model.profile.first_step_ms
    rows = np.full(len(lag), len(lag))
    return first_step(rows, lag) - first_step(rows, np.zeros_like(lag))


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
    )


def decode_basis(
    view: DecodeView, cost_model: CostModel, caught_up_share: float = 1.0
) -> PlanBasis:
    """Drafts are priced as in a decode-only round of the round's decoding requests, at the
    rate bar of the live batch.

    Next to a prefill chunk a draft rides on an eager forward of thousands of rows: its rows
    cost almost nothing, the round's own all-AR rate (the scheduler's bar: uplift x that
    rate) is a few tokens over tens of ms, and the drafter's catch-up on whole prompts,
    amortised against that round's gain, looked cheap. Those rounds took 1.8-1.9x their AR
    time at C = 32..64 in the simulator and the refill throughput fell to 0.5-0.6x all-AR
    at C = 64..128; the gain that pays a catch-up back is the one of the decode rounds that
    follow. So a round with prefill chunks is planned as its decode-only part would be. And
    while slots are still filling (live requests not decoding yet), a ms spent now delays the
    whole live batch: the bar is the uplift times the decode-only AR rate of all live
    requests.

    The uplift over AR is earned by requests whose drafter is caught up; requests that must
    catch up first cannot reach it before they have paid. So only the `caught_up_share` of
    the batch carries the uplift's excess over AR into the bar: a new wave of requests behind
    a first that speculated well is held to what it can reach, not locked out by the first
    wave's rate (code-like text, draft steps x 0.5, C = 16: the second wave stayed in AR, 0.70
    of all-spec, with the bar at 1.78x the AR rate in the simulator)."""
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
    alone, the first position of a request whose drafter must catch up came as early as any
    other of the same survival, so a prefix could take a caught-up request's deeper positions
    only together with costly entries of others. A lagging request is now worth its best mean
    net value per position, max_d (s_1 + ... + s_d - catch-up in tokens at the bar) / d, and
    none of its positions ranks above that (they stay a prefix); one whose survival never pays
    its catch-up back is left out."""
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


def deferred_catchups(view: DecodeView, profile) -> np.ndarray:
    """[n] bool: requests that do not start speculating in this round, which carries a prefill
    chunk, because their drafter would catch up in a forward of its own.

    A catch-up longer than the drafter's graphed passes (catchup_rows_per_pass rows per request,
    at most max_catchup_passes of them; every catch-up when the profile has no passes) is one
    eager forward, bound by its launches: ~15 ms whether it holds one request's prompt or
    sixteen (H200 profile, 256 to 1024 rows). Next to prefill chunks new requests arrive one
    or two per round, so starting them there pays that forward for each of them; deferred to
    the next decode-only round they catch up together in one. In the simulator (2026-11-30
    H200 profile) this took draft-half code-like text at C = 128 from 0.96x to 1.03x all-AR
    refill throughput and C = 64 from 0.98x to 1.06x, and code-like text at C = 8 from 1.05x
    to 1.07x all-spec in full-live rounds. Requests asked to speculate ("on") are never held
    back, and a probe (one observation for the prior) may still take one: held back, the
    probes of a prefill-heavy start moved into the decode-only rounds."""
    capacity = profile.catchup_rows_per_pass * profile.max_catchup_passes
    return (view.drafter_lag > capacity) & ~view.was_spec & ~view.must_spec


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
        # request in speculation. (Held, its catch-up looked sunk, and the planner took the
        # rest of a lagging batch into one shared catch-up behind it: 61 of 64 prose-like
        # requests at a predicted -7% against all-AR in the simulator, then two rounds of
        # dwell for all of them.)
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
            # ahead keeps the next ones AR (planned behind it, then held by the dwell) until
            # the bar has decayed. On the H200 (ngram, mixed, C = 16, 2026-11-30 17:36 and
            # 17:46 UTC) such exits put 4-5 of ~40 full-live rounds in AR at 0.7x the rate
            # of the speculating ones: adaptive at 0.89x all-spec. In the simulator (the
            # same record's profile, its three variants, C = 1..128, 4 seeds) the points
            # below 0.98 x the better fixed policy went from 11 to 7, geometric mean +0.5%.
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
        (Asked only whether it would speculate, auto followed every prompt at C = 64 on a
        profile whose drafter paid ~15 ms of launches per followed round: 0.62x all-AR refill
        tokens/s in the simulator, with no speculating round at all.) Changes no state."""
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
        and chain would be spent for nothing (1-2% of all-AR throughput at C = 8..128 in the
        simulator)."""
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
