"""What a speculation policy sees of a round and what it answers: `DecodeView` (arrays over the
decoding requests) -> `Decision` (drafts per request); `SpecPolicy` is the interface the
product's policies, the simulator's baselines and its simulator-only policies implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from scheduler.acceptance import AcceptanceEstimator
    from scheduler.cost_model import CostModel


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
    # [n] host ms each verified row of the request adds (a grammar's mask); None: no such request
    row_host_ms: np.ndarray | None = None


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
