"""Online calibration of the profile's prices: one correction per class of round and shape.

Every executed round compares its measured time with its uncorrected price and moves the
correction of its class (calib_class) and rows bucket in log space, so an over- and an
under-estimate of the same factor move it equally. A bucket's correction is shrunk toward its
class's running correction by the bucket's confidence (a decayed observation count), and
confidence decays every round the bucket does not run, as a class's correction decays toward 1
every round of another class: a shape that ran slow once early drifts back to the profile's
estimate and is tried again instead of being locked out by one warm-up measurement. One
correction per class, not one for all rounds: where the profile misprices speculating rounds,
every speculating round corrects all speculating shapes at once and AR rounds do not dilute
it; rounds with prefill chunks run eagerly, priced by other curves than the graphed decode
rounds, so they are a class of their own.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.cost_tables import Table

# Calibration classes: AR decode rounds, speculating decode rounds, rounds with prefill chunks.
CALIB_AR, CALIB_SPEC, CALIB_PREFILL = 0, 1, 2
NUM_CALIB_CLASSES = 3

# CALIB_ALPHA: EMA weight of one round; 0.2 averages ~5 rounds, enough to smooth the few-%
# noise of measured round times while following a real shift within ~10 rounds.
CALIB_ALPHA = 0.2
# CALIB_PRIOR_COUNT: pseudo-observations behind the class's correction; a bucket needs about
# this many runs before its own correction is trusted half-way. The planner picks among many
# speculating shapes, each in its own bucket, so a bucket whose few noisy measurements came out
# fast would otherwise win the pick (the optimiser's curse). A bucket run every round is still
# trusted ~87% (its decayed count settles near 200).
CALIB_PRIOR_COUNT = 30.0
# CALIB_DECAY: per-round confidence decay of every bucket; halves confidence after ~140 rounds
# without running it (a few seconds of serving), then the shape is re-probed.
CALIB_DECAY = 0.995
# CALIB_OUTLIER_RATIO: one round counts at most this far (as a ratio) from the correction it
# updates. A single round measured far off its price (a stall, a prompt's short last chunk)
# would otherwise move its class's correction by its full weight and misprice every round of
# the class for hundreds of rounds; a real shift of the device's pace still moves the
# correction by up to CALIB_ALPHA x log(1.5) (8%) per round.
CALIB_OUTLIER_RATIO = 1.5
_OUTLIER_LOG = math.log(CALIB_OUTLIER_RATIO)


def calib_class(has_spec, has_prefill=False):
    """The calibration class of rounds (scalars or arrays): with prefill chunks, else
    speculating or AR."""
    if not isinstance(has_spec, np.ndarray) and not isinstance(has_prefill, np.ndarray):
        # (plain truth tests: the scheduler's scalar pricing calls this per shape)
        return CALIB_PREFILL if has_prefill else (CALIB_SPEC if has_spec else CALIB_AR)
    spec = np.asarray(has_spec, dtype=np.int64)
    return np.where(np.asarray(has_prefill, dtype=bool), CALIB_PREFILL, spec)


def _clip_log(deviation: float) -> float:
    """A round's log deviation from a correction, within the outlier bound."""
    return min(max(deviation, -_OUTLIER_LOG), _OUTLIER_LOG)


class ShapeCalibration:
    """The corrections of [NUM_CALIB_CLASSES, num_shapes] (class, shape bucket) cells."""

    def __init__(self, num_shapes: int):
        shape = (NUM_CALIB_CLASSES, num_shapes)
        self._log_corr = np.zeros(shape)
        self._count = np.zeros(shape)  # decayed observations of each cell
        self._global_log_corr = np.zeros(NUM_CALIB_CLASSES)  # per class: what cells shrink to
        # exp of each cell's shrunk log correction: factors(class, bucket) or .scalar(..)
        self.factors = Table(np.ones(shape))
        self.num_observations = 0

    def observe(self, calib: int, shape_bucket: int, log_ratio: float) -> None:
        """One executed round of that cell: log(measured / uncorrected price)."""
        s, b = calib, shape_bucket
        self._count *= CALIB_DECAY
        glob = self._global_log_corr[s]
        if self._count[s, b] < 1e-3:
            # first look at this shape: take it as is, within the outlier bound of its class
            self._log_corr[s, b] = glob + _clip_log(log_ratio - glob)
        else:
            self._log_corr[s, b] += CALIB_ALPHA * _clip_log(log_ratio - self._log_corr[s, b])
        self._count[s, b] += 1.0
        # the other classes' corrections drift back to the profile while they do not run (as a
        # bucket's confidence does), so a class that looked slow is tried again
        self._global_log_corr *= CALIB_DECAY
        self._global_log_corr[s] = glob + CALIB_ALPHA * _clip_log(log_ratio - glob)
        self.num_observations += 1
        conf = self._count / (self._count + CALIB_PRIOR_COUNT)
        glob = self._global_log_corr[:, None]  # [NUM_CALIB_CLASSES, 1]
        self.factors = Table(np.exp(glob + conf * (self._log_corr - glob)))

    def confidence(self, calib: int, shape_bucket: int) -> float:
        c = self._count[calib, shape_bucket]
        return float(c / (c + CALIB_PRIOR_COUNT))
