"""What a drafter's catch-up costs the speculating rounds of its request.

A drafter that missed tokens (after a prefill, or rounds in AR) catches up on them in the
chain's first step of the request's next SPEC round. That cost is paid once and enables every
later SPEC round of the request until it leaves speculation, so the policy charges each SPEC
round a share of it: the catch-up's ms over the rounds the request is expected to keep
speculating (SpecStretches, catchup_share). Catch-ups of several requests in one round share
one first step (joint_catchup_ms; depth_planner.Catchup prices a ranked prefix the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scheduler.cost_model import CostModel

if TYPE_CHECKING:
    from scheduler.policy_api import DecodeView

# Catch-up amortisation: once caught up, the drafter stays caught up while the request
# speculates, so the catch-up serves every round the request has left: its remaining tokens
# over the tokens one of its SPEC rounds makes (1 + its survival sum), capped at 512 rounds so
# that a very long request does not treat any catch-up as free. The tokens per round are the
# request's own: a fixed low figure for all would stretch the horizon of requests that accept
# much, and they would catch up on whole prompts that their few remaining SPEC rounds never
# pay back.
CATCHUP_HORIZON_ROUNDS = 512.0


class SpecStretches:
    """How long each request keeps speculating once it has started: its own exit rate.

    A catch-up is paid back only by the SPEC rounds that follow it until the request leaves
    speculation, not by the request's whole remaining life: a request whose speculation rests
    on a lucky belief (prose-like text near break-even) drops back to AR after a round or two,
    and its drafter must catch up again on the next entry; priced over the request's life,
    such entries are taken again and again at a loss. Each request's stretch is geometric in
    this estimate: (its SPEC rounds + 1) / (its exits + 1 / CATCHUP_HORIZON_ROUNDS), so a
    request that has not left speculation yet (a new one too) keeps the whole horizon, and one
    that left after two rounds expects about three. Per request, not per batch: on mixed text
    the prose-like requests' exits must not shorten the code-like ones' horizon."""

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

    The catch-up is spread over the rounds the request can still speculate: its remaining
    tokens over the tokens one of its SPEC rounds makes at full usable depth (1 + sum of its
    survival), at most `max_rounds` and CATCHUP_HORIZON_ROUNDS. The charge is the catch-up's
    cost in ms over that horizon whatever the shape of the step-time curve: lag *rows* spread
    over rounds would be priced where the curve is flat or on its tail, depending on the
    batch. (The predicted and measured round times keep the full catch-up.)"""
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


def deferred_catchups(view: DecodeView, profile) -> np.ndarray:
    """[n] bool: requests that do not start speculating in this round, which carries a prefill
    chunk, because their drafter would catch up in a forward of its own.

    A catch-up longer than the drafter's graphed passes (catchup_rows_per_pass rows per request,
    at most max_catchup_passes of them; every catch-up when the profile has no passes) is one
    eager forward, bound by its launches: about as dear for one request's prompt as for
    sixteen. Next to prefill chunks new requests arrive one or two per round, so starting them
    there pays that forward for each of them; deferred to the next decode-only round they catch
    up together in one. Requests asked to speculate ("on") are never held back, and a probe
    (one observation for the prior) may still take one: held back too, the probes of a
    prefill-heavy start would all move into the decode-only rounds."""
    capacity = profile.catchup_rows_per_pass * profile.max_catchup_passes
    return (view.drafter_lag > capacity) & ~view.was_spec & ~view.must_spec
