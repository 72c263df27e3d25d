"""Baseline speculation policies for the simulator, each written from its public description,
plus the oracle. All plug into the real Scheduler through the SpecPolicy interface, so they
share lifecycle, KV accounting, prefill and the executor; only the per-round depths differ.

- threshold:  vLLM's dynamic speculative decoding: an offline table maps the running batch size
              to one speculation length for every request, profiled with the drafter's mean
              acceptance.
- goodput:    SmartSpec / TurboSpec: every step pick one k for all requests maximising goodput
              sum_i (1 - a_i^(k+1)) / (1 - a_i) / T(k), a_i a moving average of each request's
              acceptance rate and T a linear fit of batch time (rows, KV, drafter steps).
- sticky:     a per-request on/off gate decided once per cohort change (arrival or departure)
              from the estimates at that moment, then kept: full depth if on.
- survival:   vLLM's adaptive verification: a draft position is verified when its estimated
              survival probability pays for its row at the profiled step cost.
- oracle:     the depth planner fed with each request's true current survival curve (hidden
              state of the acceptance model) and the true, uncorrected cost curve.
"""

from __future__ import annotations

import numpy as np

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.depth_planner import Catchup, plan_depths
from scheduler.policy import (
    AdaptivePolicy,
    AllARPolicy,
    AllSpecPolicy,
    Decision,
    DecodeView,
    catchup_share,
    depth_caps,
    usable_survival,
)
from scheduler.sim.executor import SimExecutor

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
    """Per-request gate fixed at each cohort change (arrival or departure)."""

    name = "sticky"

    def __init__(self):
        self.gate: dict[int, bool] = {}

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        caps = depth_caps(view)
        if view.cohort_changed or any(int(r) not in self.gate for r in view.req_ids):
            rate = estimator.request_rate(view.slots)
            gain = uniform_expected_tokens(rate, caps) - 1.0  # [n] extra tokens at full depth
            order = np.argsort(-gain, kind="stable")
            best_k, best = (
                0,
                view.base_tokens
                / float(cost_model.predict_ms(view.base_rows, view.base_kv_tokens)),
            )
            cum_gain = np.cumsum(gain[order])
            cum_rows = np.cumsum(caps[order])
            lag = np.cumsum(view.drafter_lag[order])
            for k in range(1, n + 1):
                if caps[order[k - 1]] == 0:
                    break
                ms = cost_model.predict_ms_scalar(
                    int(view.base_rows + cum_rows[k - 1]),
                    view.base_kv_tokens,
                    int(caps[order[:k]].max()),
                    k,
                    int(lag[k - 1]),
                    view.num_prefill_rows,
                )
                rate_k = (view.base_tokens + cum_gain[k - 1]) / ms
                if rate_k > best:
                    best_k, best = k, rate_k
            on = np.zeros(n, dtype=bool)
            on[order[:best_k]] = True
            self.gate = {int(r): bool(g) for r, g in zip(view.req_ids, on)}
            reason = f"gate re-decided: {best_k}/{n} on"
        else:
            reason = "gate kept"
        on = np.fromiter((self.gate[int(r)] for r in view.req_ids), bool, n)
        return Decision(np.where(on, caps, 0).astype(np.int64), reason)


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


class OraclePolicy:
    """The depth planner with true survival curves and the true cost curve."""

    name = "oracle"

    def __init__(self, executor, profile: ProfileCost, drafter_prefill: bool):
        self.executor = executor
        self.true_cost = CostModel(profile, drafter_prefill)  # never calibrated: the truth

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        if n == 0 or not view.may_spec.any():
            return Decision(np.zeros(n, dtype=np.int64), "nothing to speculate")
        survival = usable_survival(
            view,
            self.executor.acceptance.true_survival(
                view.slots,
                np.asarray(self.executor.next_positions(view.slots.tolist())),
                view.max_drafts,
            ),
        )
        key = np.where(survival > 0, survival, -1.0)
        choice = plan_depths(
            survival,
            key,
            view.weights,
            Catchup(view.drafter_lag, catchup_share(view, survival)),
            self.true_cost,
            view.base_rows,
            view.base_kv_tokens,
            view.base_tokens,
            view.num_prefill_rows,
            view.rate_bar,
        )
        return Decision(choice.num_draft, "oracle")


POLICY_NAMES = (
    "adaptive",
    "all-ar",
    "all-spec",
    "threshold",
    "goodput",
    "sticky",
    "survival",
    "oracle",
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
    if name == "oracle":
        return OraclePolicy(executor, profile, drafter_prefill)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
