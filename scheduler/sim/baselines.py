"""Baseline speculation policies for the simulator, each written from its public description.
All plug into the real Scheduler through the SpecPolicy interface, so they share lifecycle, KV
accounting, prefill and the executor; only the per-round depths differ. (true-state and clairvoyant,
which read the acceptance model's hidden state: oracles.py.)

- threshold:  vLLM's dynamic speculative decoding: an offline table maps the running batch size
              to one speculation length for every request (profile and mean acceptance).
- goodput:    SmartSpec / TurboSpec: every step one k for all requests maximising goodput
              sum_i (1 - a_i^(k+1)) / (1 - a_i) / T(k), a_i a moving average of each request's
              acceptance rate and T a linear fit of batch time (rows, KV, drafter steps).
- sticky:     the seed system's gate: speculate a request at full depth or not, decided once at
              its admission on the cohort's EMA-calibrated rates, kept until it ends.
- survival:   vLLM's adaptive verification: a draft position is verified when its estimated
              survival probability pays for its row at the profiled step cost.
"""

from __future__ import annotations

import numpy as np

from scheduler.cost_model import ProfileCost
from scheduler.plan import RoundPlan
from scheduler.policy import (
    AdaptivePolicy,
    AllARPolicy,
    AllSpecPolicy,
    depth_caps,
    usable_survival,
)
from scheduler.policy_api import Decision, DecodeView
from scheduler.sim.executor import SimExecutor
from scheduler.sim.oracles import ClairvoyantPolicy, TrueStatePolicy

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# sticky: EMA weight of one round in the cohort's cost correction, and the gain over AR that
# an admission to speculation must predict
COST_EMA = 0.2
GATE_MARGIN = 0.01


def uniform_expected_tokens(acceptance, k):
    """Tokens of a chain of k drafts with i.i.d. acceptance a: (1 - a^(k+1)) / (1 - a)."""
    a = np.minimum(np.asarray(acceptance, dtype=np.float64), 0.999)
    return (1.0 - a ** (np.asarray(k) + 1)) / (1.0 - a)


def _uniform(view: DecodeView, k: int) -> np.ndarray:
    return np.minimum(depth_caps(view), k).astype(np.int64)


class ThresholdPolicy:
    """Batch size -> speculation length, from an offline table (profile + mean acceptance)."""

    name = "threshold"

    def __init__(
        self,
        profile: ProfileCost,
        mean_acceptance: float,
        max_drafts: int,
        mean_context: int,
    ):
        self.table: dict[int, int] = {}
        for batch in BATCH_SIZES:
            best_k, best_rate = 0, 0.0
            for k in range(max_drafts + 1):
                ms = profile.round_ms_scalar(
                    batch * (1 + k), batch * mean_context, k, batch if k else 0
                )
                rate = batch * float(uniform_expected_tokens(mean_acceptance, k)) / ms
                if rate > best_rate:
                    best_k, best_rate = k, rate
            self.table[batch] = best_k

    def decide(self, view, estimator, cost_model) -> Decision:
        batch = max((b for b in BATCH_SIZES if b <= max(view.num_live, 1)), default=1)
        k = self.table[batch]
        return Decision(_uniform(view, k), f"table[{batch}] = {k}")


class GoodputPolicy:
    """Uniform k per step by goodput with a linear cost model (SmartSpec)."""

    name = "goodput"

    def __init__(self, profile: ProfileCost):
        rows = profile.target_rows
        self.t_coef = np.polyfit(rows, profile.target_ms_points, 1)  # [slope, intercept]
        self.d_coef = np.polyfit(profile.draft_rows, profile.draft_ms_points, 1)
        self.kv_ms_per_token = profile.kv_ms_per_token

    def _linear_ms(self, num_rows, kv_tokens, k, num_spec):
        target = self.t_coef[0] * num_rows + self.t_coef[1] + kv_tokens * self.kv_ms_per_token
        draft = k * (self.d_coef[0] * num_spec + self.d_coef[1])
        return target + np.where(k > 0, draft, 0.0)

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        if n == 0 or not view.may_spec.any():
            return Decision(np.zeros(n, dtype=np.int64), "nothing to speculate")
        rate = estimator.request_rate(view.slots)  # [n] moving-average acceptance
        caps = depth_caps(view)
        ks = np.arange(view.max_drafts + 1)  # [K]
        depth = np.minimum(caps[None, :], ks[:, None])  # [K, n]
        tokens = (uniform_expected_tokens(rate[None, :], depth) * view.weights).sum(1)  # [K]
        num_spec = (depth > 0).sum(1)
        ms = self._linear_ms(
            view.base_rows + depth.sum(1), view.base_kv_tokens, ks, num_spec
        )  # [K]
        k = int(np.argmax(tokens / ms))
        return Decision(depth[k].astype(np.int64), f"goodput k={k}")


class StickyGatePolicy:
    """The seed system's gate: one decision per request, made at its admission and kept until
    it ends.

    A request is admitted when it first decodes (its first round past prefill). The gate then
    speculates it at full depth (every draft its remaining tokens allow: depth_caps) or keeps
    it in AR for its whole life; asked "on", it speculates, and without a drafter it stays AR.
    The decision is the cohort's: the decoding requests of the admission round, newcomers
    included, speculating at full depth against all in AR, each a decode-only round (drafters
    caught up) priced by the profile times the cohort-level correction of its kind, compared by
    expected tokens per ms: 1 per request, plus for each speculating one the sum of its
    estimated survival over its drafts (a newcomer's: the estimator's prior). The newcomers
    speculate only when speculating wins by more than GATE_MARGIN.

    The correction: one factor for AR rounds and one for speculating rounds, each an EMA
    (weight COST_EMA) of measured / priced time over the decode-only rounds of its kind, fed by
    observe_round (the simulator's runner calls it after every round; without it the factors
    stay at 1: the profile's price).
    """

    name = "sticky"

    def __init__(self):
        self.gate: dict[int, bool] = {}  # req_id -> speculates
        self.correction = [1.0, 1.0]  # [AR, speculating] measured / priced decode-round time
        self._profile: ProfileCost | None = None

    def decide(self, view, estimator, cost_model) -> Decision:
        self._profile = cost_model.profile
        n = len(view.req_ids)
        caps = depth_caps(view)
        req_ids = view.req_ids.tolist()
        new = [i for i, r in enumerate(req_ids) if r not in self.gate]
        if new:
            speculate = False
            if ((caps[new] > 0) & ~view.must_spec[new]).any():  # a newcomer the cohort decides
                survival = estimator.survival(view.slots)[:, : view.max_drafts]
                gain = usable_survival(view, survival).sum(1)  # [n] expected accepted drafts
                ar_rate = self.cohort_rate(view, np.zeros(n, dtype=bool), caps, gain)
                spec_rate = self.cohort_rate(view, caps > 0, caps, gain)
                speculate = spec_rate > (1.0 + GATE_MARGIN) * ar_rate
            for i in new:
                self.gate[req_ids[i]] = bool(caps[i] > 0 and (view.must_spec[i] or speculate))
        on = np.fromiter((self.gate[r] for r in req_ids), bool, n)
        reason = f"gates: {int(on.sum())}/{n} on" + (f", {len(new)} new" if new else "")
        return Decision(np.where(on, caps, 0).astype(np.int64), reason)

    def cohort_rate(self, view, on: np.ndarray, caps: np.ndarray, gain: np.ndarray) -> float:
        """Expected tokens per ms of a decode-only round of the view's requests, those `on`
        speculating at their caps, priced by the profile and the correction of its kind."""
        n = len(on)
        drafts = int(caps[on].sum())
        num_spec = int(np.count_nonzero(on))
        decode_kv = max(view.base_kv_tokens - view.num_prefill_rows, n)
        ms = self._profile.round_ms_scalar(
            n + drafts,
            decode_kv + drafts,
            int(caps[on].max(initial=0)),
            num_spec,
            num_draft_rows=drafts,
        )
        return (n + float(gain[on].sum())) / (ms * self.correction[num_spec > 0])

    def observe_round(self, plan: RoundPlan, period_ms: float) -> None:
        """One executed round and its measured period (ms): a decode-only round moves the
        correction of its kind."""
        if self._profile is None or plan.prefills or not len(plan.decode) or period_ms <= 0:
            return
        num_draft = plan.decode.num_draft
        num_spec = int(np.count_nonzero(num_draft))
        priced = self._profile.round_ms_scalar(
            plan.row_bucket or plan.num_rows,
            plan.num_kv_tokens,
            plan.spec_depth - 1 if num_spec else 0,
            num_spec,
            plan.drafter_lag_rows,
            padded=True,
            num_draft_rows=int(num_draft.sum()),
        )
        if priced > 0:
            kind = int(num_spec > 0)
            self.correction[kind] += COST_EMA * (period_ms / priced - self.correction[kind])


class SurvivalAdmissionPolicy:
    """Verify a draft position when its survival probability pays for its row."""

    name = "survival"

    def __init__(self, profile: ProfileCost, slope_window: int = 32):
        self.profile = profile
        self.window = slope_window

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        survival = usable_survival(view, estimator.survival(view.slots)[:, : view.max_drafts])
        flat = survival.ravel()
        order = np.argsort(-flat, kind="stable")
        order = order[flat[order] > 0]
        p = self.profile
        # profiled step cost and its slope at each possible row count (no buckets, no drafter)
        rows = view.base_rows + np.arange(len(order) + 1)  # [P + 1]
        step_ms = p.target_ms(rows) + p.attention_ms(view.base_kv_tokens)
        slope = (p.target_ms(rows + self.window) - p.target_ms(rows)) / self.window
        tokens = view.base_tokens + np.concatenate(([0.0], np.cumsum(flat[order])))
        # position t pays when its survival >= marginal row cost / current cost per token
        pays = flat[order] >= slope[:-1] * tokens[:-1] / step_ms[:-1]
        take = int(np.argmin(pays)) if not pays.all() else len(order)
        num_draft = np.bincount(order[:take] // view.max_drafts, minlength=n).astype(np.int64)
        return Decision(num_draft, f"survival admitted {take} positions")


POLICY_NAMES = (
    "adaptive",
    "all-ar",
    "all-spec",
    "threshold",
    "goodput",
    "sticky",
    "survival",
    "true-state",
    "clairvoyant",
)


def make_policy(
    name: str,
    *,
    profile: ProfileCost,
    executor: SimExecutor,
    max_drafts: int,
    mean_context: int,
    drafter_prefill: bool,
):
    if name == "adaptive":
        return AdaptivePolicy()
    if name == "all-ar":
        return AllARPolicy()
    if name == "all-spec":
        return AllSpecPolicy()
    if name == "threshold":
        return ThresholdPolicy(
            profile,
            executor.acceptance.mean_acceptance(),
            max_drafts,
            mean_context,
        )
    if name == "goodput":
        return GoodputPolicy(profile)
    if name == "sticky":
        return StickyGatePolicy()
    if name == "survival":
        return SurvivalAdmissionPolicy(profile)
    if name == "true-state":
        return TrueStatePolicy(executor, profile, drafter_prefill)
    if name == "clairvoyant":
        return ClairvoyantPolicy(executor, drafter_prefill)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
