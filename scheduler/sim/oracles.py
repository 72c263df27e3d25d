"""Simulator-only policies that see what no server can: the acceptance model's hidden state.

- true-state:  the depth planner fed each request's exact survival curve given its hidden
               state (the best information a causal policy could have: the chain is Markov,
               so past outcomes add nothing to the state) and the true, uncorrected cost curve.
               Its planner is the product's per-round heuristic, so it is no upper bound.
- clairvoyant: the best depths of every round. It reads each request's realised acceptance
               outcomes of the coming round from its trace and searches the round's choices
               priced as the simulated executor charges them: a bound per round, not over a
               run (ClairvoyantPolicy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.depth_planner import Catchup, plan_depths
from scheduler.plan import RoundPlan
from scheduler.policy import catchup_share, depth_caps, usable_survival
from scheduler.policy_api import Decision, DecodeView
from scheduler.sim.executor import RoundShape, SimExecutor

# screened candidates of a round that are priced exactly (executor.round_cost_ms) at the end
EXACT_CANDIDATES = 8


class TrueStatePolicy:
    """The depth planner with true survival curves and the true cost curve."""

    name = "true-state"

    def __init__(self, executor: SimExecutor, profile: ProfileCost, drafter_prefill: bool):
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
        return Decision(choice.num_draft, "true-state")


@dataclass(frozen=True)
class RoundFacts:
    """What clairvoyant knows of one round's decoding requests."""

    view: DecodeView
    caps: np.ndarray  # [n] most drafts each may use (depth_caps)
    runs: np.ndarray  # [n] drafts of a chain as deep as the cap the target will accept
    lag: np.ndarray  # [n] context rows each drafter has not seen (the executor's own count)
    share: np.ndarray  # [n] fraction of a request's catch-up charged to this round
    base_tokens: float  # tokens without drafts


@dataclass(frozen=True)
class InFlight:
    """A round announced before the executor runs it (ClairvoyantPolicy.plan_in_flight)."""

    slots: np.ndarray  # [m] its decoding requests' slots
    num_draft: np.ndarray  # [m]
    positions: np.ndarray  # [m] their next output index before it runs


class ClairvoyantPolicy:
    """`clairvoyant`: per round, the best choice of drafts given the round's realised outcomes.

    Each request's run (how many drafts of a chain as deep as its cap the target will accept)
    is read from its trace, which the executor then replays: a request drafting d emits exactly
    1 + min(d, run). The search covers, for every chain depth m, every speculating count k and
    every draft-row total D, the k requests first in one of two orders (longest usable run
    min(run, m) first, or least drafter lag first), each drafting at least one and at most
    min(cap, m), accepted drafts placed before rejected ones. Drafts past the runs stay
    candidates because the cost curves are not monotone (in the shipped profile 8 rows cost
    more than 16). Candidates are screened with the profile's array prices at chain depth m;
    the best EXACT_CANDIDATES and all-AR are priced as the executor charges them (buckets, KV,
    drafter chain, host and restart time, any time scale; noise left out). The choice maximises
    `tokens - rate_bar * ms` (the view's rate bar; tokens / ms without one), every token
    counted in full.

    One thing is not priced as charged: a drafter's catch-up enables every later round the
    request speculates in, so a round is charged the share of it that policy.catchup_share
    gives from the request's true survival. Charged whole, a catch-up rarely pays for itself
    within one round, and requests in AR would stay there while their lag grows.

    What this bounds: no causal policy knows the runs, and per round the choice is the best of
    the family by this objective; of small batches, the best of every depth vector
    (tests/scheduler/test_simulator_baselines.py checks it exhaustively). It does not plan
    across rounds (the positions, contexts and lags later rounds start from, which rounds are
    full-live), so it is no bound over a run: on the small test grid it leads every other
    policy with the timing noise off (seed 0), and at seed 2 threshold passes it at mixed
    C = 16. A decision made while the round before it runs (decide_ahead) reads the traces
    where that round's outcomes leave them (plan_in_flight).
    """

    name = "clairvoyant"

    def __init__(self, executor: SimExecutor, drafter_prefill: bool):
        self.executor = executor
        self.drafter_prefill = drafter_prefill
        self.in_flight: InFlight | None = None

    def plan_in_flight(self, plan: RoundPlan) -> None:
        """The round that runs before the next decision takes effect: a decision made while it
        runs (decide_ahead) reads the traces where its outcomes leave them."""
        dec = plan.decode
        self.in_flight = InFlight(
            dec.slots.copy(), dec.num_draft.copy(), self.executor.slot_next_index[dec.slots]
        )

    def decide(self, view, estimator, cost_model) -> Decision:
        n = len(view.req_ids)
        caps = depth_caps(view)
        if n == 0 or not caps.any():
            return Decision(np.zeros(n, dtype=np.int64), "nothing to speculate")
        facts = self.facts(view, caps)
        best_obj, best = None, np.zeros(n, dtype=np.int64)
        for num_draft in [best, *self._screen(facts)]:
            obj = self.objective(facts, num_draft)
            if best_obj is None or obj > best_obj:
                best_obj, best = obj, num_draft
        accepted = int(np.minimum(best, facts.runs).sum())
        return Decision(best, f"clairvoyant: {int(best.sum())} drafts, {accepted} accepted")

    def facts(self, view: DecodeView, caps: np.ndarray) -> RoundFacts:
        ex = self.executor
        slots = view.slots.tolist()
        positions, lag = self._positions_and_lag(view.slots)
        runs = [
            ex.acceptance.accepted(s, p, c) if c else 0
            for s, p, c in zip(slots, positions.tolist(), caps.tolist())
        ]
        survival = ex.acceptance.true_survival(view.slots, positions, view.max_drafts)
        return RoundFacts(
            view=view,
            caps=caps,
            runs=np.asarray(runs, dtype=np.int64),
            lag=lag,
            share=catchup_share(view, usable_survival(view, survival)),
            # (the view's weights only steer drain-time choices, outside full-live rounds)
            base_tokens=view.base_tokens - float(view.weights.sum()) + len(slots),
        )

    def _positions_and_lag(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n] each slot's next output index and drafter lag when the decision takes effect:
        the executor's, advanced as the executor will by a round in flight it has not run."""
        ex = self.executor
        positions = ex.slot_next_index[slots].astype(np.int64)
        lag = ex.slot_lag[slots].astype(np.int64)
        flight = self.in_flight
        if flight is None or not np.array_equal(ex.slot_next_index[flight.slots], flight.positions):
            return positions, lag  # (the round has run: the executor's state is current)
        row = {s: i for i, s in enumerate(slots.tolist())}
        for slot, d, pos in zip(
            flight.slots.tolist(), flight.num_draft.tolist(), flight.positions.tolist()
        ):
            i = row.get(slot)
            if i is None:
                continue
            accepted = ex.acceptance.accepted(slot, pos, d) if d else 0
            positions[i] = pos + 1 + accepted
            lag[i] = int(accepted == d) if d else lag[i] + 1
        return positions, lag

    def objective(self, facts: RoundFacts, num_draft: np.ndarray) -> float:
        """The score of one depth vector, priced as the executor charges it but for the
        catch-up, charged at its share."""
        view = facts.view
        spec = num_draft > 0
        num_spec = int(np.count_nonzero(spec))
        drafts = int(num_draft.sum())
        rows = view.base_rows + drafts
        executed = rows if view.num_prefill_rows else int(self.executor.profile.bucket(rows))
        lag = facts.lag[spec]
        period = []
        for lag_rows in (int(lag.sum()), 0):
            shape = RoundShape(
                num_rows=rows,
                executed_rows=executed,
                num_kv_tokens=view.base_kv_tokens + drafts,
                draft_depth=int(num_draft.max(initial=0)),
                num_spec=num_spec,
                num_draft_rows=drafts,
                lag_rows=lag_rows,
                num_prefill_rows=view.num_prefill_rows,
                follow_prefill=self.drafter_prefill,
                num_decoding=len(num_draft),
                decode_only=view.num_prefill_rows == 0,
            )
            period.append(sum(self.executor.round_cost_ms(shape)))
        weight = float((lag * facts.share[spec]).sum()) / max(int(lag.sum()), 1)
        ms = period[1] + (period[0] - period[1]) * weight
        tokens = facts.base_tokens + float(np.minimum(num_draft, facts.runs).sum())
        return float(_score(tokens, ms, view.rate_bar))

    def _screen(self, facts: RoundFacts) -> list[np.ndarray]:
        """The best EXACT_CANDIDATES depth vectors of the family (class doc) by array prices."""
        caps, runs, lag = facts.caps, facts.runs, facts.lag
        eligible = np.flatnonzero(caps > 0)
        found = []  # (score, order, m, k, D)
        for m in range(1, int(caps.max()) + 1):
            usable = np.minimum(runs, m)  # [n] accepted of a chain as deep as m
            by_run = eligible[np.lexsort((lag[eligible], -usable[eligible]))]
            by_lag = eligible[np.lexsort((-usable[eligible], lag[eligible]))]
            for order in (by_run,) if np.array_equal(by_run, by_lag) else (by_run, by_lag):
                score, k, drafts = self._prefix_scores(facts, m, order)
                top = np.argsort(-score, kind="stable")[:EXACT_CANDIDATES]
                found += [(float(score[t]), order, m, int(k[t]), int(drafts[t])) for t in top]
        found.sort(key=lambda f: -f[0])
        return [
            _depths(len(caps), order, np.minimum(runs, m), np.minimum(caps, m), k, d)
            for _, order, m, k, d in found[:EXACT_CANDIDATES]
        ]

    def _prefix_scores(self, facts: RoundFacts, depth: int, order: np.ndarray):
        """Score of every (k, D): the first k requests of `order` drafting D in all, priced with
        a chain as deep as `depth` (the deepest any of them may draft: never cheaper than the
        chain they run)."""
        view = facts.view
        usable = np.minimum(facts.runs[order], depth)  # [e]
        room = np.minimum(facts.caps[order], depth)  # [e] most drafts of each
        lag = facts.lag[order]
        num_d = np.cumsum(room) - np.arange(len(room))  # [e] draft totals of each prefix
        prefix = np.repeat(np.arange(len(room)), num_d)  # [c] prefix of each candidate
        k = prefix + 1
        start = np.cumsum(num_d) - num_d  # [e] first candidate of each prefix
        drafts = k + np.arange(len(k)) - start[prefix]  # [c] from k to the prefix's room
        # each drafts one; those whose run is 0 waste it, the rest accept up to their runs
        accepted = np.minimum(drafts - np.cumsum(usable == 0)[prefix], np.cumsum(usable)[prefix])
        lag_rows = np.cumsum(lag)[prefix]
        weight = (np.cumsum(lag * facts.share[order]) / np.maximum(np.cumsum(lag), 1))[prefix]
        rows = view.base_rows + drafts
        p = self.executor.profile
        price = [
            p.round_ms(
                rows,
                view.base_kv_tokens + drafts,
                depth,
                k,
                lag_part,
                view.num_prefill_rows,
                self.drafter_prefill,
                drafts,
            )
            for lag_part in (lag_rows, 0)
        ]
        ms = price[1] + (price[0] - price[1]) * weight
        scale = self.executor.time_scale
        if scale is not None:
            ms = ms * np.array([scale(int(r), True) for r in rows.tolist()])
        return _score(facts.base_tokens + accepted, ms, view.rate_bar), k, drafts


def _score(tokens, ms, rate_bar: float):
    """The planner's objective (depth_planner): tokens - rate_bar * ms, or tokens / ms."""
    return tokens - rate_bar * ms if rate_bar > 0 else tokens / ms


def _depths(n, order, usable, room, k, num_drafts) -> np.ndarray:
    """[n] drafts per request: the first k of `order` one each, then accepted drafts, then
    rejected ones up to each request's room, in order, until `num_drafts` are placed."""
    chosen = order[:k]
    depth = np.ones(k, dtype=np.int64)
    left = num_drafts - k
    for limit in (np.maximum(usable[chosen], 1), room[chosen]):
        extra = limit - depth
        take = np.minimum(extra, np.maximum(left - (np.cumsum(extra) - extra), 0))
        depth += take
        left -= int(take.sum())
    out = np.zeros(n, dtype=np.int64)
    out[chosen] = depth
    return out
