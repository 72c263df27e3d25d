"""The scheduler's round-time model: the profile's prices with the online calibration applied.

`CostModel` = `ProfileCost` (what the profile says a round of a given shape costs,
scheduler/profile_cost.py) x `ShapeCalibration` (what the rounds executed so far say about
that price, by class of round and shape bucket, scheduler/cost_calibration.py). Predictions
take one shape in plain Python numbers (`*_scalar`: the scheduler and the policy ask for a few
per round) or numpy arrays of shapes; `spec_row_terms` gives the depth planner the terms it
prices all its speculating candidates of a round with.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from scheduler.cost_calibration import ShapeCalibration, calib_class
from scheduler.cost_tables import keyword_twin
from scheduler.profile_cost import ProfileCost

__all__ = ["CostModel", "ProfileCost"]


class CostModel:
    """ProfileCost with per-shape-bucket online correction (see module doc).
    `drafter_prefill`: whether the round priced next has its prefill chunks followed by the
    drafter (the scheduler sets it per round)."""

    def __init__(self, profile: ProfileCost, drafter_prefill: bool = False):
        self.profile = profile
        self.drafter_prefill = drafter_prefill
        self.calibration = ShapeCalibration(len(profile.row_buckets) + 1)

    @classmethod
    def from_file(cls, path: str | Path, drafter_prefill: bool = False) -> CostModel:
        return cls(ProfileCost.from_file(path), drafter_prefill)

    @property
    def num_observations(self) -> int:
        return self.calibration.num_observations

    def correction(self, num_rows, has_spec, has_prefill=False) -> np.ndarray:
        """The calibration factors of rounds of `num_rows` rows (arrays) and their class."""
        bucket = self.profile.bucket_index(num_rows)
        return self.calibration.factors(calib_class(has_spec, has_prefill), bucket)

    def correct_ms_scalar(
        self, raw_ms: float, num_rows: int, has_spec: bool, has_prefill: bool = False
    ) -> float:
        """The calibrated prediction of a shape whose raw_ms_scalar is already known."""
        bucket = self.profile.shape_bucket.scalar(num_rows)
        return raw_ms * self.calibration.factors.nested[calib_class(has_spec, has_prefill)][bucket]

    def predict_ms(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        num_draft_rows=None,
        *,
        scalar=False,
        calibrated=True,
    ):
        """Predicted round time in ms: ProfileCost.round_ms (with this model's drafter_prefill)
        times the correction of the round's shape bucket and class (`calibrated`; else the
        profile's price alone). Broadcast arrays, or one shape (`scalar`, as
        predict_ms_scalar)."""
        raw = self.profile.round_ms(
            num_rows,
            num_kv_tokens,
            draft_depth,
            num_spec,
            drafter_lag_rows,
            num_prefill_rows,
            self.drafter_prefill,
            num_draft_rows,
            scalar=scalar,
        )
        if not calibrated:
            return raw
        if scalar:
            return self.correct_ms_scalar(raw, num_rows, draft_depth > 0, num_prefill_rows > 0)
        has_spec, has_prefill = np.asarray(draft_depth) > 0, np.asarray(num_prefill_rows) > 0
        return raw * self.correction(num_rows, has_spec, has_prefill)

    # The one-shape forms: the same code (keyword_twin: no call in between).
    predict_ms_scalar = keyword_twin(predict_ms, "predict_ms_scalar", scalar=True)
    # the uncorrected price of one shape: what observe takes
    raw_ms_scalar = keyword_twin(predict_ms, "raw_ms_scalar", scalar=True, calibrated=False)

    def predict_spec_grid(
        self,
        base_rows: int,
        base_kv_tokens: int,
        extra_rows: np.ndarray,
        depth: np.ndarray,
        num_spec: np.ndarray,
        lag_rows: np.ndarray,
        num_prefill_rows: int,
    ) -> np.ndarray:
        """predict_ms of many speculating candidates of one round (depth >= 1), sharing its base
        rows and KV: each candidate adds `extra_rows` draft rows (arguments broadcast). Same
        values as predict_ms, via 1-D tables over the few distinct row and request counts.
        With the spec-round tables the groups' excess is priced from each candidate's own
        draft rows (predict_ms with num_draft_rows = extra_rows)."""
        p = self.profile
        corr, fixed = self.spec_row_terms(
            base_rows, base_kv_tokens, int(extra_rows.max()), num_prefill_rows
        )
        num_spec = np.asarray(num_spec)
        lag_rows = np.asarray(lag_rows)
        if p.has_spec_tables:
            draft = p.spec_terms_ms(num_spec, extra_rows, depth)
            if lag_rows.any():
                draft = draft + p.catchup_extra_ms(num_spec, lag_rows)
        else:
            step = p.draft_step_ms(np.arange(int(num_spec.max()) + 1))  # [K] one chain step
            first = p.first_step_ms(num_spec, lag_rows) if lag_rows.any() else step[num_spec]
            draft = first + (depth - 1) * step[np.maximum(num_spec, 1)] + p.propose_ms(num_spec)
        return corr[extra_rows] * (fixed[extra_rows] + draft) * p.spec_ratio(num_spec)

    def spec_row_terms(
        self, base_rows: int, base_kv_tokens: int, max_extra_rows: int, num_prefill_rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The draft-row-dependent terms of predict_spec_grid, for `extra` = 0..max_extra_rows
        draft rows on top of the round's base: (corr, fixed), each [max_extra_rows + 1]. A
        speculating candidate of k requests, d_max drafts and `extra` draft rows is predicted at
        corr[extra] * (fixed[extra] + profile.spec_terms_ms(k, extra, d_max) + catch-up ms)
        * profile.spec_ratio(k),
        the same value predict_spec_grid gives (catch-up: profile.catchup_extra_ms of its lag
        rows). Over many prefixes of one ranked order, profile.spec_terms(num_spec) gives the
        same spec terms with the per-request lookups done once (SpecTerms)."""
        p = self.profile
        extra = np.arange(max_extra_rows + 1)  # [R]
        rows = base_rows + extra
        target = p.prefill_target_ms(rows) if num_prefill_rows else p.padded_target_ms(rows)  # [R]
        fixed = self._spec_fixed(target, base_rows, base_kv_tokens, extra, num_prefill_rows)
        return self.correction(rows, True, num_prefill_rows > 0), fixed

    def _spec_fixed(self, target, base_rows, base_kv_tokens, extra, num_prefill_rows):
        """[R] what a speculating candidate of `extra` [R] draft rows pays besides its spec
        terms: the target at its rows (`target` [R]), the KV term, a following drafter's
        prefill forward, the engine's host time by the round's decoding requests (round_ms
        infers them from its rows: the same when every speculating request drafts the same
        depth) and the drafts' reads of the draft KV past the reference context."""
        p = self.profile
        fixed = target + (base_kv_tokens + extra) * p.kv_ms_per_token
        if self.drafter_prefill and num_prefill_rows:
            fixed = fixed + p.follow_ms(num_prefill_rows)
        num_decoding = base_rows - num_prefill_rows
        fixed = fixed + p.spec_host_ms_scalar(num_decoding)
        decode_kv = max(base_kv_tokens - num_prefill_rows, 0)
        return fixed + p.draft_kv_ms(extra, decode_kv, num_decoding)

    def observe(
        self,
        num_rows: int,
        has_spec: bool,
        raw_predicted_ms: float,
        measured_ms: float,
        has_prefill: bool = False,
    ):
        """Feeds one executed round: `raw_predicted_ms` is the uncorrected prediction."""
        if raw_predicted_ms <= 0 or measured_ms <= 0:
            return
        log_ratio = math.log(measured_ms / raw_predicted_ms)
        bucket = self.profile.bucket_index_scalar(num_rows)
        self.calibration.observe(calib_class(has_spec, has_prefill), bucket, log_ratio)

    def confidence(self, num_rows: int, has_spec: bool, has_prefill: bool = False) -> float:
        bucket = self.profile.bucket_index_scalar(num_rows)
        return self.calibration.confidence(calib_class(has_spec, has_prefill), bucket)
