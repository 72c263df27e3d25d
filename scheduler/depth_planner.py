"""Which decoding requests speculate this round, and how deep: maximise expected tokens per ms.

`plan_depths` ranks every (request, draft position) by value and prices every prefix of that
ranking with the exact round cost (graph buckets, drafter chain, KV term, calibration) for each
cap on the deepest chain, keeping the best prefix or no speculation at all; its doc gives the
objective. `Catchup` is how drafter catch-ups enter the price of a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORCE_KEY = 1e9  # ranking key of positions that must be taken (dwell, speculation "on")


@dataclass(frozen=True)
class Catchup:
    """The drafter catch-up that speculating requests bring into the chain's first step.

    The catch-up rows of every request that speculates in a round go through one first step
    (one forward, or passes of a few rows per request), so what a lagging request costs is
    what its rows add to that shared step, not a forward of its own: an eager forward of the
    draft model is bound by its kernel launches (about as dear for 256 rows as for 1024), and
    pricing each request's whole-prompt catch-up as one such forward would charge a batch of
    16 lagging requests 16 forwards where the round runs one. A prefix's catch-up is
    priced as the cost model's first step over all its lag rows, less the plain step, and
    split among its requests by lag rows; each request's part is charged at its `share` (the
    fraction of its catch-up this round carries, see catchup_pricing.catchup_share)."""

    lag_rows: np.ndarray  # [n] context rows each request's drafter has not seen
    share: np.ndarray  # [n] fraction of its catch-up charged to this round


def prefix_catchup_ms(
    catchup: Catchup,
    req_of: np.ndarray,  # [P] request of each ranked position
    first: np.ndarray,  # [P] bool: the position is its request's first draft
    num_spec: np.ndarray,  # [P] speculating requests of the prefix ending here
    cost_model,
) -> np.ndarray:
    """[P] catch-up ms charged to the prefix ending at each ranked position (see Catchup).
    Only first positions add lag, so it is priced at those (n values, not n * D) and carried to
    the deeper positions after each."""
    reqs = req_of[first]  # [m] requests in the order their first positions rank
    lag = catchup.lag_rows[reqs]  # [m]
    if not lag.any():
        return np.zeros(len(req_of))
    lag_total = np.cumsum(lag)  # [m]
    charged_rows = np.cumsum(lag * catchup.share[reqs])  # [m] lag rows x share
    k = np.arange(1, len(reqs) + 1)  # [m] speculating requests of each prefix
    first_step = cost_model.profile.first_step_ms
    joint = first_step(k, lag_total) - first_step(k, np.zeros_like(lag_total))  # [m]
    charge = np.maximum(joint, 0.0) * charged_rows / np.maximum(lag_total, 1)  # [m]
    # (a request's first position ranks before its deeper ones: num_spec >= 1 past the first)
    return np.where(num_spec > 0, charge[np.maximum(num_spec - 1, 0)], 0.0)


@dataclass(frozen=True)
class DepthChoice:
    num_draft: np.ndarray  # [n] int drafts per request (0: AR)
    predicted_ms: float
    predicted_tokens: float
    ar_ms: float  # predicted time of the all-AR alternative
    ar_tokens: float


def plan_depths(
    survival: np.ndarray,  # [n, D] s_ij, D = max drafts
    rank_key: np.ndarray,  # [n, D] ranking key (survival * hysteresis, FORCE_KEY, <= 0: excluded)
    weights: np.ndarray,  # [n] value of a token of request i
    catchup: np.ndarray | Catchup,  # joint catch-up, or [n] ms charged to i's first position
    cost_model,  # CostModel (predict_ms_scalar, spec_row_terms, profile.spec_terms)
    base_rows: int,  # rows without drafts: one per decoding request + prefill chunk rows
    base_kv_tokens: int,
    base_tokens: float,  # tokens without drafts: sum(weights) + prefill completions
    num_prefill_rows: int,
    rate_bar: float = 0.0,
    row_ms: np.ndarray | None = None,  # [n] host ms each draft row of request i adds, or None
) -> DepthChoice:
    """The drafts per request that maximise the round's objective, with its predicted cost.

    Expected tokens of the round: every decoding request emits 1 token (the AR row, or the
    bonus/correction token of its chain), plus for each chosen draft position (i, j) its
    survival probability s_ij = a_i1 * ... * a_ij, weighted by the request's value weight w_i
    (1, or less while draining). Position (i, j) can only be taken after (i, j-1); since s_ij
    falls with j, ranking all positions by value keeps every request's positions a prefix.

    The round time is not additive: target rows are padded to a graph bucket, the drafter
    chain costs one step per position of the *deepest* request (d_max) over all speculating
    requests, and the first step also catches the drafter up on tokens it missed (the rows of
    every catching-up request of a prefix go through that one step together: Catchup). So for
    every cap c = d_max in 1..D the positions with j <= c are ranked by value (a marginal-gain
    order: each next position adds its survival probability and one row), every prefix of
    that ranking is priced exactly, and the best prefix over all caps is kept, or no
    speculation at all when that is better. The search is one argsort of n * D values, then
    per cap a dozen array operations over its own n * c ranked positions (n * D * (D + 1) / 2
    values in all, every array at most n * D long: small enough to stay in the allocator's
    pools, where one [D, n * D] grid of temporaries would page memory in and out every round).

    What "best" means: the long-run rate is total tokens / total time, and the rounds' states
    differ (a request is easy now, hard later). Maximising each round's own ratio tokens / ms
    would compare a position's survival with *this* round's rate: too low a bar while requests
    are hard (over-speculating) and too high a bar while they are easy. The renewal-reward
    optimum instead maximises `tokens - rate_bar * ms` every round, where `rate_bar` is the
    long-run rate of the regime (Dinkelbach's parametric form of a ratio objective): a
    position is taken when its survival pays for its marginal time at the rate the server
    earns on average. The policy passes the regime's rate (policy.RateTracker); rate_bar = 0
    keeps the plain per-round ratio. `row_ms` prices what a draft row costs its request beyond
    the round's rows (a grammar's mask on the host), summed over the prefix's positions."""
    n, max_drafts = survival.shape
    ar_ms = cost_model.predict_ms_scalar(base_rows, base_kv_tokens, 0, 0, 0, num_prefill_rows)
    none = DepthChoice(np.zeros(n, dtype=np.int64), ar_ms, base_tokens, ar_ms, base_tokens)
    if n == 0 or max_drafts == 0:
        return none
    flat_key = rank_key.ravel()  # [n * D]
    candidates = np.flatnonzero(flat_key > 0)
    if len(candidates) == 0:
        return none
    order = candidates[np.argsort(-flat_key[candidates], kind="stable")]  # [P]
    req_of = order // max_drafts  # [P] request of each ranked position
    pos_of = order % max_drafts  # [P] 0-based draft position
    value = survival.ravel()[order] * weights[req_of]  # [P]
    num_forced = int(np.count_nonzero(flat_key[order] >= FORCE_KEY))

    # A request's first draft is inside every cap, so the speculating count and the catch-up
    # rows of a prefix do not depend on the cap.
    first = pos_of == 0  # [P]
    num_spec = np.cumsum(first)  # [P] speculating requests of the prefix ending here
    if isinstance(catchup, Catchup):
        catchup_ms = prefix_catchup_ms(catchup, req_of, first, num_spec, cost_model)  # [P]
    else:
        catchup_ms = np.cumsum(np.where(first, catchup[req_of], 0.0))  # [P]
    corr, fixed = cost_model.spec_row_terms(
        base_rows, base_kv_tokens, len(order), num_prefill_rows
    )  # [P + 1] each, by draft rows taken
    # what the speculating set adds beyond its rows (the groups' target excess over the AR
    # curve, the drafter's proposal, a model-free drafter's host time), by prefix; catch-ups
    # on top
    spec_terms = cost_model.profile.spec_terms(num_spec)
    spec_ratio = cost_model.profile.spec_ratio(num_spec)  # [P] the engine's over the terms'
    # A prefix must contain every forced position (they rank first, all at depth 1, so they
    # lead every cap's list too).
    start = max(num_forced - 1, 0)
    best_value = base_tokens - rate_bar * ar_ms if rate_bar > 0 else base_tokens / ar_ms
    best = None  # (value, cap, positions taken, predicted ms, tokens)
    for cap in range(1, max_drafts + 1):
        # Prefixes that end on a position past the cap repeat their predecessor's selection:
        # only the cap's own positions are candidate ends.
        taken = np.flatnonzero(pos_of < cap) if cap < max_drafts else np.arange(len(order))
        if len(taken) <= start:
            continue
        tokens = base_tokens + np.cumsum(value[taken])  # [m] tokens of each prefix
        num_rows = len(taken)
        draft = spec_terms(taken, np.arange(1, num_rows + 1), cap) + catchup_ms[taken]  # [m]
        if row_ms is not None:
            draft = draft + np.cumsum(row_ms[req_of[taken]])
        ms = corr[1 : num_rows + 1] * (fixed[1 : num_rows + 1] + draft) * spec_ratio[taken]
        # Objective: tokens - rate_bar * ms (see module doc); rate_bar 0: tokens / ms.
        rate = tokens - rate_bar * ms if rate_bar > 0 else tokens / ms
        last = start + int(np.argmax(rate[start:]))
        # strictly better only: ties go to the smaller cap (fewer drafter steps)
        if (best is None and (num_forced or rate[last] > best_value)) or (
            best is not None and rate[last] > best[0]
        ):
            best = (float(rate[last]), cap, taken[: last + 1], float(ms[last]), tokens[last])
    if best is None:
        return none
    _, _, chosen, predicted_ms, predicted_tokens = best
    num_draft = np.bincount(req_of[chosen], minlength=n).astype(np.int64)
    return DepthChoice(num_draft, predicted_ms, float(predicted_tokens), ar_ms, base_tokens)
