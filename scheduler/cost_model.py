"""Round-time cost model: the executor's profile as a function, plus online calibration.

Predicted round time (ms), following the profile's own description:

    target(bucket(rows)) + kv_tokens * kv_bytes_per_token / kv_read_bandwidth
      + drafter: one step over (num_spec + drafter_lag_rows) rows, then (d_max - 1) steps
        over num_spec rows                      (a chain of depth d_max costs d_max steps);
        a drafter that takes catch-ups in passes of `catchup_rows_per_pass` rows per request
        (draft_model, graphed) pays one step per pass for the first one (first_step_ms)
      + drafter prefill over the round's prefill rows (when the drafter follows prefills)
      + a model-free drafter's proposal time on the host over num_spec requests (`drafter_host`)

Speculating rounds as served (profiles that have the tables; older ones keep the terms above):

- `target.spec_rows_ms` ([k, r, ms]: whole rounds of k speculating sequences of r rows each at
  the reference context, KV term subtracted as in `rows_ms`) prices what verifying groups costs
  beyond AR rows: excess(k, r) = spec_rows_ms(k, r) - target(k * r), made non-decreasing in r
  and k (a measured excess below a shallower or smaller group's is taken as noise: with rows
  padded to a bucket the round must not get cheaper as drafts are added), 0 at r = 1. A round
  with k speculating requests carrying D draft rows in all (D = k * d_max unless the caller
  knows them) pays target(bucket(rows)) + excess(k, 1 + D / k): a pure speculating round of a
  profiled shape costs its measurement exactly, and AR rows and padding next to the groups cost
  the difference of the target curve. The excess is interpolated linearly in r and log-linearly
  in k between the profiled counts, proportional to k outside them.
- `draft_model.propose_ms` ([k, d, ms]: one whole proposal of d drafts for k requests right
  after a verified round, its first step catching up the usual 1-2 rows per request) replaces
  first_step + (d - 1) steps: linear in d between the profiled drafts (plus chain steps past
  the deepest, proportional below the shallowest), log-linear in k (plus d steps' growth of the
  step curve past the largest count), non-decreasing in both. A catch-up of `drafter_lag_rows`
  (rounds the drafter missed) keeps its pass pricing on top: first_step(k, lag) -
  first_step(k, 0).
- `draft_model.kv_ms_per_token` (ms per draft and per token of context past the proposals'
  `context_len`) prices the draft KV every step reads: D drafts of a batch whose decoding
  requests hold T tokens of KV (n requests) cost D * rate * (T / n - context_len) on top
  (`draft_kv_ms`; less below the reference context). T is the round's KV less its draft and
  prefill rows, so in a round with a later chunk of a prompt it still holds that prompt's
  computed prefix (at 16 requests a 2k-token prefix adds ~0.4 ms at the H200's rate). Without
  the term a proposal for 16 requests at 16k tokens of context each was priced as at 1k, and
  the planner took more drafts there than at 1k (more of the round is the target's KV read,
  which drafts do not add to).
- `target.spec_round_ratio` ([k, ratio]: full-depth speculating rounds of k requests as the
  engine ran them at profiling time, over the price of the terms above) scales a speculating
  round's whole price, by its speculating requests (flat outside the measured counts; absent:
  1). The terms are measured piece by piece, rounds alone and proposals alone; on the H200 of
  2026-11-30 02:57 UTC the engine's speculating steps cost 14-32% more than their sum.

An AR-only decode round (no drafts, no prefill chunk) runs ahead in the engine: the host's work
between rounds hides behind the device's, so its cost is scaled by the profile's
`ar_ahead_ratio` (period of rounds run ahead / the round alone, measured per row count at the
reference context, flat past its last point; absent in older profiles: 1). A speculating round
cannot run ahead (its successor's drafts need its accepted tokens), so the engine's host work
around it (planning, the scheduler's update, output collection) adds to its period: the
profile's `spec_host_ms_per_round` over the round's decoding requests (absent: 0). That term
is the engine's, not the executor's: calibration compares the executor's measured time with
the prediction without it (`spec_host_ms_scalar`). The first AR round after a speculating round
starts from an idle pipeline: `ar_restart_ms` (by decoding requests; absent: 0) is what it costs
beyond a steady AR round, also the engine's (`ar_restart_ms_scalar`; the simulator charges it,
the round prices do not).

`target(r)` interpolates the profiled dense cost (projections, MLP, LM head) between its points
and extends the last segment linearly; attention is not in those numbers, hence the KV term with
one KV scan per sequence. Rows are padded to the graph bucket (the profile's points) when the
round is replayed from a graph.

Calibration: every executed round compares the measured time with the uncorrected prediction
and moves a per-shape-bucket correction (rows bucket x speculating or not) in log space, so an
over- and an under-estimate of the same factor move it equally (symmetric). Each bucket keeps a
confidence (decayed observation count); its correction is shrunk toward its class's
correction (AR-only rounds, or rounds with a drafter chain: one running correction each) by that
confidence, and confidence decays every round a bucket is not run, as a class's correction
decays toward 1 every round of the other class. A shape that ran slow once early therefore
drifts back to the profile's honest estimate and is tried again, instead of being locked out by
a single warm-up measurement. One correction per class, not one for all rounds: where the
profile prices speculating rounds too low (the H200 run of 2026-11-30 02:57 UTC measured them
14-32% above it), every speculating round corrects all speculating shapes at once, and AR rounds
do not dilute it. With the engine on a CPU priced by that run's profile and its speculating
rounds charged 1.3x (`python -m loadtests.policy_replay --spec-bias 1.3 --noise 0.05
--prompt-len 1024`), code-like text at C = 16 speculated on 21% of request-rounds with one
correction for all rounds (56% at 15% noise), and on 0.2% with one per class (9% at 15% noise;
unbiased, 64%: it still speculates where speculating rounds cost what the profile says).
Rounds with prefill chunks are a third class: their eager forward is priced by other curves than
the graphed decode rounds, and the H200 measured it 10-20% above the profile (2026-11-30 04:30
UTC). Counted as AR rounds, the two dozen prefill rounds that start a refill run raised the AR
correction to ~1.2 while no AR decode round had run yet, and the all-AR alternative of a
speculating batch was priced 25-40% above what AR rounds then took (code-like text, C = 16..32:
"pred +35-50% tok/s vs AR" for rounds that earned +8%).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import numpy as np

# Calibration classes: AR decode rounds, speculating decode rounds, rounds with prefill chunks.
CALIB_AR, CALIB_SPEC, CALIB_PREFILL = 0, 1, 2
NUM_CALIB_CLASSES = 3


def calib_class(has_spec, has_prefill=False):
    """The calibration class of rounds (scalars or arrays): with prefill chunks, else
    speculating or AR."""
    if not isinstance(has_spec, np.ndarray) and not isinstance(has_prefill, np.ndarray):
        # (plain truth tests: the planner's scalar pricing calls this per candidate)
        return CALIB_PREFILL if has_prefill else (CALIB_SPEC if has_spec else CALIB_AR)
    spec = np.asarray(has_spec, dtype=np.int64)
    return np.where(np.asarray(has_prefill, dtype=bool), CALIB_PREFILL, spec)


# Calibration constants (why these values):
# - CALIB_ALPHA: EMA weight of one round; 0.2 averages ~5 rounds, enough to smooth the few-%
#   noise of measured round times while following a real shift within ~10 rounds.
# - CALIB_PRIOR_COUNT: pseudo-observations behind the all-bucket correction; a bucket needs about
#   this many runs before its own correction is trusted half-way. The planner picks among many
#   speculating shapes, each in its own bucket, so a bucket whose few noisy measurements came out
#   fast wins the pick (the optimiser's curse): with 3, the engine on a CPU with the H200
#   profile's prices as its measured times speculated on 18.5% of prose request-rounds at C = 8
#   under 5% timing noise, against 0.4% with 30 and in the simulator
#   (`python -m loadtests.policy_replay --profile docs/perf/gpu.json --noise 0.05`). With 30
#   a bucket run every round is still trusted 87% (its decayed count settles near 200).
# - CALIB_DECAY: per-round confidence decay of every bucket; 0.995 halves confidence after ~140
#   rounds without running it (a few seconds of serving), then the shape is re-probed.
# - CALIB_OUTLIER_RATIO: one round counts at most this far (as a ratio) from the correction it
#   updates. A round measured far off its price (4-19x, 1-3 times per benchmark record on the
#   H200, 2026-11-30; in the 15:30 UTC record every such round carried a prompt's short last
#   chunk) moved a class's correction by its full weight: one AR round measured at 88 ms
#   against 4.7 raised the AR correction to 1.75x, 190 rounds later it was still 1.40x, and
#   meanwhile speculation was priced +8% to +74% against AR and run at a loss (prose-like text
#   at C = 1: 0.86x all-AR in that run). A real shift of the device's pace still moves the
#   correction by up to CALIB_ALPHA x log(1.5) (8%) per round.
CALIB_ALPHA = 0.2
CALIB_PRIOR_COUNT = 30.0
CALIB_DECAY = 0.995
CALIB_OUTLIER_RATIO = 1.5
_OUTLIER_LOG = math.log(CALIB_OUTLIER_RATIO)


def _clip_log(deviation: float) -> float:
    """A round's log deviation from a correction, within the outlier bound
    (CALIB_OUTLIER_RATIO)."""
    return min(max(deviation, -_OUTLIER_LOG), _OUTLIER_LOG)


def _tail_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """Slope of the last segment, never below 0 (0 for a single point: a flat curve). More rows
    never cost less: a last segment that falls within the timing noise (the draft model's
    launch-bound catch-up forward, 15.8 ms at 256 rows and 14.5 ms at 1024 in the H200
    profile) would otherwise price a catch-up of 16 whole prompts below zero."""
    if len(xs) < 2:
        return 0.0
    return max(float((ys[-1] - ys[-2]) / (xs[-1] - xs[-2])), 0.0)


def interp_linear_tail(x, xs: np.ndarray, ys: np.ndarray):
    """Piecewise-linear interpolation that continues the last segment past the end and is
    clamped to the first point below the start."""
    y = np.interp(x, xs, ys)
    slope = _tail_slope(xs, ys)
    return np.where(x > xs[-1], ys[-1] + (np.asarray(x) - xs[-1]) * slope, y)


TABLE_ROWS = 16384  # row counts with a precomputed cost; larger ones use the linear tail
SPEC_TABLE_REQS = 1024  # speculating-request counts with precomputed spec-round terms
SPEC_TABLE_DRAFTS = 32  # drafts per request with a precomputed proposal cost (spec depth <= 32)


def _complete_grid(points, min_second: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[m, 3] (count, second key, ms) points -> (counts [K], keys [J], ms [K, J]): the keys above
    `min_second`, and only the counts measured at every key (a shape left out for lack of KV
    space leaves its count out)."""
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    keys = np.unique(pts[pts[:, 1] > min_second, 1])  # [J]
    cells = {(float(k), float(j)): float(ms) for k, j, ms in pts}
    counts = [k for k in np.unique(pts[:, 0]) if k >= 1 and all((k, j) in cells for j in keys)]
    grid = np.array([[cells[(k, j)] for j in keys] for k in counts], dtype=np.float64)
    grid = grid.reshape(len(counts), len(keys))
    return np.asarray(counts, dtype=np.float64), keys, grid


def _over_requests(counts: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """[K, J] values at the measured request counts -> [SPEC_TABLE_REQS, J] at every count,
    log-linear between them and flat outside (row 0 copies row 1)."""
    k = np.arange(1, SPEC_TABLE_REQS, dtype=np.float64)
    out = np.empty((SPEC_TABLE_REQS, grid.shape[1]))
    for j in range(grid.shape[1]):
        out[1:, j] = np.interp(np.log(k), np.log(counts), grid[:, j])
    out[0] = out[1]
    return out


class _Curve:
    """A profiled cost curve over integer row counts: table lookups inside, linear tail past."""

    def __init__(self, table: np.ndarray, slope: float):
        self.table = table  # [TABLE_ROWS] cost of each row count
        self.table_list = table.tolist()
        self.end = float(table[-1])
        self.slope = slope

    @classmethod
    def from_points(cls, xs: np.ndarray, ys: np.ndarray) -> _Curve:
        table = interp_linear_tail(np.arange(TABLE_ROWS), xs, ys)
        return cls(table, _tail_slope(xs, ys))

    def __call__(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.max(initial=0) < TABLE_ROWS:
            return self.table[rows]  # the common case: one gather
        inside = self.table[np.minimum(rows, TABLE_ROWS - 1)]
        return np.where(rows < TABLE_ROWS, inside, self.end + (rows - TABLE_ROWS + 1) * self.slope)

    def scalar(self, rows: int) -> float:
        if rows < TABLE_ROWS:
            return self.table_list[rows]
        return self.end + (rows - TABLE_ROWS + 1) * self.slope


def wide_pass_padded_rows(rows: np.ndarray, cap: int, buckets: np.ndarray) -> np.ndarray:
    """Rows a forward of `rows` rows computes in passes of `cap` rows (all but the last full),
    the last padded to the smallest of `buckets` holding it (unpadded above the largest)."""
    rows = np.asarray(rows, dtype=np.int64)
    full = np.maximum(-(-rows // cap) - 1, 0) * cap  # rows of the full passes
    rest = rows - full  # [..] 0 < rest <= cap where rows > 0
    idx = np.minimum(np.searchsorted(buckets, rest), len(buckets) - 1)
    return full + np.maximum(buckets[idx], rest) * (rest > 0)


def wide_catchup_ms(curve, rows: np.ndarray, cap: int, buckets: np.ndarray) -> np.ndarray:
    """A wide forward of `rows` rows run in passes of `cap` rows (all but the last full), priced
    from `curve` (ms by rows, vectorised: one forward of whole buckets measured): the last pass
    at its padded rows, each full pass before it at what a second pass adds to one,
    curve(2 cap) - curve(cap). On the H200 (2026-11-30) catch-ups of 2-8 uneven prompts were
    priced so 3-9% under their time, against 4-18% read at the rows as they are
    (`docs/perf/catchup.md`)."""
    rows = np.asarray(rows, dtype=np.int64)
    full = np.maximum(-(-rows // cap) - 1, 0)  # full passes before the last
    last = wide_pass_padded_rows(rows - full * cap, cap, buckets)
    per_pass = float(curve(np.array([2 * cap]))[0] - curve(np.array([cap]))[0])
    return curve(last) + full * per_pass


class ProfileCost:
    """The uncorrected cost curves of a profile JSON (the format of the shared H200 profile)."""

    def __init__(self, profile: dict):
        target = profile["target"]
        rows_ms = np.asarray(target["rows_ms"], dtype=np.float64)  # [num_points, 2]
        self.target_rows = rows_ms[:, 0]  # [num_points]
        self.target_ms_points = rows_ms[:, 1]  # [num_points]
        self.kv_ms_per_token = (
            target["kv_bytes_per_token"] / (target["kv_read_TBps_assumed"] * 1e12) * 1e3
        )
        draft = profile.get("draft_model")
        if draft:
            draft_ms = np.asarray(draft["rows_ms_per_step"], dtype=np.float64)  # [points, 2]
            # Rows past the chain steps' range only come from catch-ups: one forward of a
            # prompt's rows, measured as such where the profile has it (`catchup_rows_ms`).
            catchup = np.asarray(draft.get("catchup_rows_ms") or [], dtype=np.float64)
            if len(catchup):
                catchup = catchup[catchup[:, 0] > draft_ms[:, 0].max()]
                draft_ms = np.concatenate([draft_ms, catchup.reshape(-1, 2)])
            self.draft_rows = draft_ms[:, 0]
            self.draft_ms_points = draft_ms[:, 1]
        else:
            self.draft_rows = np.array([1.0, 2.0])
            self.draft_ms_points = np.zeros(2)
        # proposals beyond the reference context: ms per draft per token of its request's
        # context past `context_len` (absent in older profiles: proposals priced at that context)
        self.draft_kv_ms_per_token = float((draft or {}).get("kv_ms_per_token") or 0.0)
        self.draft_context_len = float((draft or {}).get("context_len") or 0.0)
        # catch-up in passes (absent: one forward of all rows, whatever their number)
        self.catchup_rows_per_pass = int((draft or {}).get("catchup_rows_per_pass") or 0)
        self.max_catchup_passes = int((draft or {}).get("max_catchup_passes") or 1)
        # a model-free drafter's proposal time on the host (prompt lookup), by speculating requests
        lookup = (profile.get("drafter_host") or {}).get("propose_ms") or [[1, 0.0]]
        lookup = np.asarray(lookup, dtype=np.float64)
        self._propose = np.interp(np.arange(TABLE_ROWS), lookup[:, 0], np.maximum(lookup[:, 1], 0))
        self._propose_list = self._propose.tolist()
        host = np.asarray(target.get("spec_host_ms_per_round") or [[1, 0.0]], dtype=np.float64)
        # [TABLE_ROWS] by decoding requests, flat outside the measured counts
        self._spec_host = np.interp(np.arange(TABLE_ROWS), host[:, 0], np.maximum(host[:, 1], 0))
        self._spec_host_list = self._spec_host.tolist()
        # speculating rounds as the engine runs them over their price, by speculating requests
        # (absent: 1), flat outside the measured counts
        spec_ratio = np.asarray(target.get("spec_round_ratio") or [[1, 1.0]], dtype=np.float64)
        self._spec_ratio = np.interp(
            np.arange(TABLE_ROWS), spec_ratio[:, 0], np.clip(spec_ratio[:, 1], 0.5, 3.0)
        )  # [TABLE_ROWS]
        self._spec_ratio_list = self._spec_ratio.tolist()
        # the switch from speculating back to AR: what the first AR round after a speculating
        # one costs beyond a steady AR round, by decoding requests (absent: 0)
        restart = np.asarray(target.get("ar_restart_ms") or [[1, 0.0]], dtype=np.float64)
        self._restart_list = np.interp(
            np.arange(TABLE_ROWS), restart[:, 0], np.maximum(restart[:, 1], 0)
        ).tolist()
        ratio = np.asarray(target.get("ar_ahead_ratio") or [[1, 1.0]], dtype=np.float64)
        # flat outside the measured row counts (np.interp clamps)
        self._ahead_ratio = _Curve(
            np.interp(np.arange(TABLE_ROWS), ratio[:, 0], np.clip(ratio[:, 1], 0.05, 1.0)), 0.0
        )
        # Graph buckets are the profiled row counts: these are the shapes that were measured.
        self.row_buckets = np.asarray(self.target_rows, dtype=np.int64)  # [num_points]
        self.name = profile.get("name", "profile")
        self._target = _Curve.from_points(self.target_rows, self.target_ms_points)
        # Rounds with prefill chunks run eagerly: priced by the profile's prefill rounds where it
        # has them (`prefill_rows_ms`), flat below the fewest rows measured. An eager round is
        # bound by launching its kernels, not by its rows: on the H200 (2026-11-30 record) rounds
        # with 9-18 prefill rows took 21.8-43.5 ms, which the graphed decode curve this used to
        # follow there priced at 5.7-5.9 ms (256 rows: 17.7 ms profiled).
        prefill = np.asarray(target.get("prefill_rows_ms") or [], dtype=np.float64).reshape(-1, 2)
        if len(prefill):
            self._prefill = _Curve.from_points(prefill[:, 0], prefill[:, 1])
        else:
            self._prefill = self._target
        self._draft = _Curve.from_points(self.draft_rows, self.draft_ms_points)
        # A catch-up past the passes is one eager forward (the passes' graphs hold a few rows
        # per request): launch-bound, so priced at the measured whole-forward times
        # (`catchup_rows_ms`), flat below the fewest rows measured, and not at the graphed chain
        # step of as many rows (1.4-5.3 ms for 1-128 rows against 15.8 ms measured for an eager
        # forward of 256 on the H200; the engine's 33-row catch-up priced at 2.5 ms drew
        # requests back into speculation exactly at that lag).
        eager = np.asarray((draft or {}).get("catchup_rows_ms") or [], dtype=np.float64)
        eager = eager.reshape(-1, 2)
        self._eager = _Curve.from_points(eager[:, 0], eager[:, 1]) if len(eager) else self._draft
        # A graphed drafter runs such a forward in passes of `catchup_pass_rows`, all but the
        # last full, the last replayed at its row bucket (`catchup_pass_buckets`): priced by
        # wide_catchup_ms. Read at the rows as they are (uneven prompts fall between the measured
        # whole buckets), catch-ups ran 20-40% over their price on the H200 (2026-11-30).
        buckets = np.asarray((draft or {}).get("catchup_pass_buckets") or [], dtype=np.int64)
        if len(eager) and len(buckets):
            cap = int((draft or {}).get("catchup_pass_rows") or buckets[-1])
            table = wide_catchup_ms(self._eager, np.arange(TABLE_ROWS), cap, buckets)
            self._eager = _Curve(table, (table[-1] - table[-1 - cap]) / cap)
        table_rows = np.arange(TABLE_ROWS)
        # target cost at the graph bucket of each row count (eager past the largest bucket)
        self._padded = _Curve(self._target(self.bucket(table_rows)), self._target.slope)
        self.bucket_index_table = np.searchsorted(self.row_buckets, table_rows)  # [TABLE_ROWS]
        self.bucket_index_list = self.bucket_index_table.tolist()
        # speculating rounds as served (module doc); None in older profiles: today's terms
        self._excess_r, self._excess = self._excess_table(target.get("spec_rows_ms"))
        self._excess_r_list = self._excess_r.tolist()
        self._excess_width = np.diff(self._excess_r)  # [J - 1] (an empty table: unused)
        self._excess_flat = None if self._excess is None else self._excess.ravel()
        self._excess_width_list = self._excess_width.tolist()
        if self._excess is not None:
            # per request count k the excess is piecewise linear in the draft rows D, with
            # breaks at D = k * (r_j - 1): intercept + D * slope on segment j (the planner's
            # form, SpecTerms), [SPEC_TABLE_REQS, J - 1] each
            k = np.maximum(np.arange(SPEC_TABLE_REQS), 1)[:, None]  # (row 0 is all zero)
            r = self._excess_r
            self._excess_slope = np.diff(self._excess, axis=1) / (k * np.diff(r))
            self._excess_intercept = self._excess[:, :-1] - k * (r[:-1] - 1.0) * self._excess_slope
        self._excess_list = None if self._excess is None else self._excess.tolist()
        self._chain = self._chain_table((draft or {}).get("propose_ms"))
        self._chain_list = None if self._chain is None else self._chain.tolist()
        self.has_spec_tables = self._excess is not None or self._chain is not None

    def _excess_table(self, spec_rows_ms) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (rows per sequence [J], excess ms [SPEC_TABLE_REQS, J]) from `spec_rows_ms`: a
        speculating round's target cost beyond the AR curve at the same rows (module doc)."""
        counts, rows_per_seq, grid = _complete_grid(spec_rows_ms or [], 1.0)
        r = np.concatenate([[1.0], rows_per_seq])  # [J] r = 1: AR rows, no excess
        if not len(counts) or not len(rows_per_seq):
            return r, None
        ar = self._target(np.rint(counts[:, None] * rows_per_seq[None, :]))  # [K, J - 1]
        excess = np.concatenate([np.zeros((len(counts), 1)), grid - ar], axis=1)  # [K, J]
        excess = np.maximum.accumulate(np.maximum.accumulate(excess, axis=1), axis=0)
        table = _over_requests(counts, excess)  # [SPEC_TABLE_REQS, J]
        k = np.arange(SPEC_TABLE_REQS, dtype=np.float64)[:, None]  # [SPEC_TABLE_REQS, 1]
        # outside the profiled counts the excess per speculating request stays
        table = np.where(k < counts[0], excess[0] * k / counts[0], table)
        table = np.where(k > counts[-1], excess[-1] * k / counts[-1], table)
        return r, table

    def _chain_table(self, propose_ms) -> np.ndarray | None:
        """[SPEC_TABLE_REQS, SPEC_TABLE_DRAFTS + 1] a draft model's whole proposal by
        (speculating requests, drafts) from `propose_ms` (module doc), or None."""
        counts, drafts, grid = _complete_grid(propose_ms or [], 0.0)
        if not len(counts) or not len(drafts):
            return None
        grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=1), axis=0)
        by_reqs = _over_requests(counts, grid)  # [SPEC_TABLE_REQS, J]
        k = np.arange(SPEC_TABLE_REQS)
        step = self._draft(np.maximum(k, 1))  # [SPEC_TABLE_REQS] one chain step
        # past the largest profiled count: the growth of d chain steps on top
        grow = np.maximum(step - self._draft(int(counts[-1])), 0.0)[:, None] * drafts[None, :]
        by_reqs = np.where((k > counts[-1])[:, None], by_reqs + grow, by_reqs)
        by_reqs = np.maximum.accumulate(by_reqs, axis=0)
        d = np.arange(SPEC_TABLE_DRAFTS + 1, dtype=np.float64)
        if len(drafts) > 1:  # linear in d between the profiled drafts
            j = np.clip(np.searchsorted(drafts, d, side="right") - 1, 0, len(drafts) - 2)
            w = np.clip((d - drafts[j]) / (drafts[j + 1] - drafts[j]), 0.0, 1.0)
            table = by_reqs[:, j] * (1.0 - w) + by_reqs[:, j + 1] * w
        else:
            table = np.repeat(by_reqs, len(d), axis=1)
        # shallower than profiled: proportional; deeper: plain chain steps on the deepest
        table = np.where(d < drafts[0], by_reqs[:, :1] * d / drafts[0], table)
        deeper = by_reqs[:, -1:] + (d - drafts[-1]) * step[:, None]
        return np.where(d > drafts[-1], deeper, table)

    @classmethod
    def from_file(cls, path: str | Path) -> ProfileCost:
        with open(path) as f:
            return cls(json.load(f))

    def bucket(self, num_rows):
        """Padded row count for graph replay; rows above the largest bucket run eagerly
        (returned unpadded). Works on scalars and arrays."""
        idx = np.searchsorted(self.row_buckets, num_rows)
        idx_c = np.minimum(idx, len(self.row_buckets) - 1)
        return np.where(idx < len(self.row_buckets), self.row_buckets[idx_c], num_rows)

    def bucket_index(self, num_rows):
        """Shape-bucket id of a row count (len(buckets) for eager shapes)."""
        rows = np.asarray(num_rows, dtype=np.int64)
        last = len(self.row_buckets)
        return np.where(
            rows < TABLE_ROWS, self.bucket_index_table[np.minimum(rows, TABLE_ROWS - 1)], last
        )

    def bucket_index_scalar(self, num_rows: int) -> int:
        return self.bucket_index_list[num_rows] if num_rows < TABLE_ROWS else len(self.row_buckets)

    def target_ms(self, num_rows):
        return self._target(num_rows)

    def follow_ms(self, num_rows: int) -> float:
        """A draft model's forward over `num_rows` prefill rows it follows (the catch-up
        curve, as rounds that follow their chunks are priced)."""
        return self._eager.scalar(num_rows)

    def prefill_target_ms(self, num_rows):
        """Target cost of a round with a prefill chunk (eager)."""
        return self._prefill(num_rows)

    def padded_target_ms(self, num_rows):
        """Target cost of a decode-only round: its rows padded to the graph bucket."""
        return self._padded(num_rows)

    def ahead_ratio_scalar(self, num_rows: int) -> float:
        """The factor an AR-only decode round's time takes when it runs ahead."""
        return self._ahead_ratio.scalar(num_rows)

    def draft_step_ms(self, num_rows):
        return self._draft(num_rows)

    def first_step_ms(self, num_spec, lag_rows):
        """The chain's first step: the last committed token of `num_spec` requests plus
        `lag_rows` catch-up rows among them, in passes of `catchup_rows_per_pass` rows per
        request (the rows spread evenly over the requests) up to `max_catchup_passes`, else
        one forward. Scalars or arrays."""
        num_spec = np.asarray(num_spec, dtype=np.float64)
        lag_rows = np.asarray(lag_rows, dtype=np.float64)
        rows = num_spec + lag_rows
        if not self.catchup_rows_per_pass:
            return self._draft(rows)
        per_req = rows / np.maximum(num_spec, 1.0)
        passes = np.ceil(per_req / self.catchup_rows_per_pass)
        one = passes > self.max_catchup_passes
        passes = np.where(one, 1.0, np.maximum(passes, 1.0))
        return np.where(one, self._eager(rows), passes * self._draft(rows / passes))

    def propose_ms(self, num_spec):
        """A model-free drafter's proposal for `num_spec` requests (0 for a draft model)."""
        return self._propose[np.clip(np.asarray(num_spec, dtype=np.int64), 0, TABLE_ROWS - 1)]

    def propose_ms_scalar(self, num_spec: int) -> float:
        return self._propose_list[min(max(num_spec, 0), TABLE_ROWS - 1)]

    def catchup_profiled_ms(self, num_spec: int, lag_rows: int) -> float:
        """A catch-up's cost beyond the plain first step as the profile prices it in a
        speculating round (with the round factor): what a drafter's measured catch-up
        (`PhaseTimes.catchup_ms`) stands against."""
        if not lag_rows:
            return 0.0
        extra = self.first_step_ms_scalar(num_spec, lag_rows) - self._draft.scalar(num_spec)
        return extra * self.spec_ratio_scalar(num_spec)

    def first_step_ms_scalar(self, num_spec: int, lag_rows: int) -> float:
        """first_step_ms for one shape in plain Python (the planner's hot path)."""
        rows = num_spec + lag_rows
        if not (lag_rows and self.catchup_rows_per_pass):
            return self._draft.scalar(rows)
        passes = math.ceil(rows / max(num_spec, 1) / self.catchup_rows_per_pass)
        if passes > self.max_catchup_passes:
            return self._eager.scalar(rows)
        passes = max(passes, 1)
        return passes * self._draft.scalar(int(rows / passes))

    def spec_excess_ms(self, num_spec, num_draft_rows):
        """The target's cost beyond the AR curve of `num_spec` speculating requests verifying
        `num_draft_rows` drafts in all (0 without `spec_rows_ms`). Scalars or arrays."""
        k = np.asarray(num_spec, dtype=np.int64)
        if self._excess is None:
            return np.zeros(np.broadcast(k, np.asarray(num_draft_rows)).shape)
        kc = np.clip(k, 1, SPEC_TABLE_REQS - 1)
        r, width = self._excess_r, self._excess_width
        per_seq = 1.0 + np.asarray(num_draft_rows, dtype=np.float64) / kc
        j = np.clip(np.searchsorted(r, per_seq, side="right") - 1, 0, len(r) - 2)
        idx = kc * len(r) + j  # flat index of the segment's start
        lo = self._excess_flat.take(idx)
        y = lo + (per_seq - r.take(j)) / width.take(j) * (self._excess_flat.take(idx + 1) - lo)
        return y * _excess_scale(k)

    def spec_excess_ms_scalar(self, num_spec: int, num_draft_rows: int) -> float:
        if self._excess_list is None or num_spec <= 0:
            return 0.0
        last = SPEC_TABLE_REQS - 1
        kc = min(num_spec, last)
        r = self._excess_r_list
        row = self._excess_list[kc]
        per_seq = 1.0 + num_draft_rows / kc
        j = min(max(bisect.bisect_right(r, per_seq) - 1, 0), len(r) - 2)
        y = row[j] + (per_seq - r[j]) / self._excess_width_list[j] * (row[j + 1] - row[j])
        return y * (num_spec / last) if num_spec > last else y

    def chain_ms(self, num_spec, depth):
        """The drafter's whole proposal of `depth` drafts for `num_spec` requests without a
        catch-up beyond the usual (`propose_ms`; without it first_step + (depth - 1) steps)."""
        k = np.asarray(num_spec, dtype=np.int64)
        d = np.asarray(depth, dtype=np.int64)
        if self._chain is None:
            return self._draft(k) + (np.maximum(d, 1) - 1) * self._draft(np.maximum(k, 1))
        last = SPEC_TABLE_REQS - 1
        t = self._chain[np.clip(k, 0, last), np.clip(d, 0, SPEC_TABLE_DRAFTS)]
        if k.max(initial=0) > last:
            t = t + np.where(k > last, d * (self._draft(k) - self._draft(last)), 0.0)
        if d.max(initial=0) > SPEC_TABLE_DRAFTS:
            extra = (d - SPEC_TABLE_DRAFTS) * self._draft(np.maximum(k, 1))
            t = t + np.where(d > SPEC_TABLE_DRAFTS, extra, 0.0)
        return t

    def chain_ms_scalar(self, num_spec: int, depth: int) -> float:
        if self._chain_list is None:
            return self._draft.scalar(num_spec) + (max(depth, 1) - 1) * self._draft.scalar(
                max(num_spec, 1)
            )
        last = SPEC_TABLE_REQS - 1
        t = self._chain_list[min(max(num_spec, 0), last)][min(max(depth, 0), SPEC_TABLE_DRAFTS)]
        if num_spec > last:
            t += depth * (self._draft.scalar(num_spec) - self._draft.scalar(last))
        if depth > SPEC_TABLE_DRAFTS:
            t += (depth - SPEC_TABLE_DRAFTS) * self._draft.scalar(max(num_spec, 1))
        return t

    def catchup_extra_ms(self, num_spec, lag_rows):
        """What a catch-up of `lag_rows` adds to the chain's first step (passes priced as
        first_step_ms does): 0 without lag. Scalars or arrays."""
        lag_rows = np.asarray(lag_rows)
        extra = self.first_step_ms(num_spec, lag_rows) - self._draft(np.asarray(num_spec))
        return np.where(lag_rows > 0, extra, 0.0)

    def catchup_extra_ms_scalar(self, num_spec: int, lag_rows: int) -> float:
        if not lag_rows:
            return 0.0
        return self.first_step_ms_scalar(num_spec, lag_rows) - self._draft.scalar(num_spec)

    def spec_terms_ms(self, num_spec, num_draft_rows, depth):
        """Everything the speculating set adds to a round beyond its rows' target cost, KV and
        the engine's host time, without catch-ups: the target's excess for the groups, the
        drafter's proposal (chain_ms) and a model-free drafter's host time. Arrays; the
        planner prices a candidate as corr * (fixed + spec_terms + catch-up) (spec_row_terms)."""
        return (
            self.chain_ms(num_spec, depth)
            + self.propose_ms(num_spec)
            + self.spec_excess_ms(num_spec, num_draft_rows)
        )

    def spec_terms(self, num_spec) -> SpecTerms:
        """spec_terms_ms of the prefixes of one ranked order of draft positions, `num_spec`
        [P] speculating requests of each, set up once for the planner's loop over caps."""
        return SpecTerms(self, num_spec)

    def spec_ratio(self, num_spec):
        """The profile's `spec_round_ratio` at `num_spec` speculating requests (1 without it)."""
        return self._spec_ratio[np.clip(np.asarray(num_spec, dtype=np.int64), 0, TABLE_ROWS - 1)]

    def spec_ratio_scalar(self, num_spec: int) -> float:
        return self._spec_ratio_list[min(max(num_spec, 0), TABLE_ROWS - 1)]

    def spec_host_ms(self, num_seqs):
        """The engine's host time around a speculating round of `num_seqs` decoding requests."""
        return self._spec_host[np.clip(np.asarray(num_seqs, dtype=np.int64), 0, TABLE_ROWS - 1)]

    def spec_host_ms_scalar(self, num_seqs: int) -> float:
        return self._spec_host_list[min(max(num_seqs, 0), TABLE_ROWS - 1)]

    def ar_restart_ms_scalar(self, num_seqs: int) -> float:
        """The switch back to AR: the first AR round after a speculating round, `num_seqs`
        decoding requests, costs this beyond a steady AR round (the profile's `ar_restart_ms`;
        the engine launches it ahead from an idle pipeline)."""
        return self._restart_list[min(max(num_seqs, 0), TABLE_ROWS - 1)]

    def round_spec_host_ms(
        self,
        num_rows: int,
        num_prefill_rows: int,
        num_spec: int,
        draft_depth: int,
        num_draft_rows: int | None = None,
    ) -> float:
        """spec_host_ms of a speculating round given as round_ms_scalar takes it: its decoding
        requests are its rows less prefill and draft rows (`num_draft_rows`, default
        num_spec x draft_depth; at least its speculating ones)."""
        drafts = num_spec * draft_depth if num_draft_rows is None else num_draft_rows
        seqs = num_rows - num_prefill_rows - drafts
        return self.spec_host_ms_scalar(max(seqs, num_spec))

    def draft_kv_ms(self, num_draft_rows, decode_kv_tokens, num_decoding):
        """What `num_draft_rows` drafts cost beyond their proposal's price at the profile's
        reference context, for decoding requests of `decode_kv_tokens` tokens of KV in all
        (`num_decoding` of them): each draft's step reads its request's draft KV, priced at the
        batch's mean context (`draft_model.kv_ms_per_token`; 0 without it). Negative below the
        reference context. Scalars or arrays."""
        if not self.draft_kv_ms_per_token:
            return np.zeros(np.broadcast(np.asarray(num_draft_rows), decode_kv_tokens).shape)
        context = np.asarray(decode_kv_tokens, dtype=np.float64) / np.maximum(num_decoding, 1)
        return (
            self.draft_kv_ms_per_token
            * np.asarray(num_draft_rows)
            * (context - self.draft_context_len)
        )

    def draft_kv_ms_scalar(
        self, num_draft_rows: int, decode_kv_tokens: int, num_decoding: int
    ) -> float:
        if not self.draft_kv_ms_per_token:
            return 0.0
        context = decode_kv_tokens / max(num_decoding, 1)
        return self.draft_kv_ms_per_token * num_draft_rows * (context - self.draft_context_len)

    def attention_ms(self, num_kv_tokens):
        return np.asarray(num_kv_tokens) * self.kv_ms_per_token

    def round_ms(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        drafter_prefill=False,
        num_draft_rows=None,
    ):
        """Uncorrected round time in ms (scalars or broadcastable arrays). Decode-only rounds
        are padded to their graph bucket; rounds with a prefill chunk run eagerly (priced by
        the profile's prefill rounds where it has them).
        `num_draft_rows`: the round's draft rows (default: num_spec * draft_depth)."""
        t = np.where(
            np.asarray(num_prefill_rows) > 0, self._prefill(num_rows), self._padded(num_rows)
        )
        t = t + self.attention_ms(num_kv_tokens)
        draft_depth = np.asarray(draft_depth)
        ahead = (draft_depth == 0) & (np.asarray(num_prefill_rows) == 0)
        t = t * np.where(ahead, self._ahead_ratio(num_rows), 1.0)
        num_spec = np.asarray(num_spec)
        if self._chain is None:
            first = self.first_step_ms(num_spec, drafter_lag_rows)
            rest = (np.maximum(draft_depth, 1) - 1) * self._draft(np.maximum(num_spec, 1))
        else:
            first = self.chain_ms(num_spec, draft_depth)
            rest = self.catchup_extra_ms(num_spec, drafter_lag_rows)
        drafts = num_spec * draft_depth if num_draft_rows is None else num_draft_rows
        seqs = np.asarray(num_rows) - num_prefill_rows - drafts
        host = self.spec_host_ms(np.maximum(seqs, num_spec)) + self.propose_ms(num_spec)
        if self._excess is not None:
            host = host + self.spec_excess_ms(num_spec, drafts)
        decode_kv = np.maximum(np.asarray(num_kv_tokens) - drafts - num_prefill_rows, 0)
        host = host + self.draft_kv_ms(drafts, decode_kv, seqs)
        t = t + np.where(draft_depth > 0, first + rest + host, 0.0)
        if drafter_prefill and np.any(num_prefill_rows):
            # (one wide forward of the draft model over the chunks: the catch-up curve)
            t = t + np.where(num_prefill_rows > 0, self._eager(num_prefill_rows), 0.0)
        return t * np.where(draft_depth > 0, self.spec_ratio(num_spec), 1.0)

    def round_ms_scalar(
        self,
        num_rows: int,
        num_kv_tokens: int,
        draft_depth: int = 0,
        num_spec: int = 0,
        drafter_lag_rows: int = 0,
        num_prefill_rows: int = 0,
        drafter_prefill: bool = False,
        padded: bool = False,
        num_draft_rows: int | None = None,
        executor_only: bool = False,
    ) -> float:
        """round_ms for one shape in plain Python (no array overhead). `padded`: num_rows is
        already the executed (padded or eager) row count. `executor_only`: less the engine's
        host time around a speculating round, the part an executor's own measured round time
        stands for (what a priced executor reports)."""
        if num_prefill_rows:
            t = self._prefill.scalar(num_rows)
        elif padded:
            t = self._target.scalar(num_rows)
        else:
            t = self._padded.scalar(num_rows)
        t += num_kv_tokens * self.kv_ms_per_token
        if draft_depth == 0 and not num_prefill_rows:
            t *= self._ahead_ratio.scalar(num_rows)
        if draft_depth > 0:
            if self._chain_list is None:
                t += self.first_step_ms_scalar(num_spec, drafter_lag_rows)
                t += (draft_depth - 1) * self._draft.scalar(max(num_spec, 1))
            else:
                t += self.chain_ms_scalar(num_spec, draft_depth)
                t += self.catchup_extra_ms_scalar(num_spec, drafter_lag_rows)
            host = self.round_spec_host_ms(
                num_rows, num_prefill_rows, num_spec, draft_depth, num_draft_rows
            )
            t += host
            t += self._propose_list[min(num_spec, TABLE_ROWS - 1)]
            drafts = num_spec * draft_depth if num_draft_rows is None else num_draft_rows
            if self._excess_list is not None:
                t += self.spec_excess_ms_scalar(num_spec, drafts)
            if self.draft_kv_ms_per_token:
                seqs = num_rows - num_prefill_rows - drafts
                decode_kv = max(num_kv_tokens - drafts - num_prefill_rows, 0)
                t += self.draft_kv_ms_scalar(drafts, decode_kv, seqs)
        if drafter_prefill and num_prefill_rows:
            t += self._eager.scalar(num_prefill_rows)
        if draft_depth > 0:
            t *= self._spec_ratio_list[min(max(num_spec, 0), TABLE_ROWS - 1)]
            if executor_only:  # (the spec ratio prices the round with the host time in it)
                t -= host
        return t


def _excess_scale(num_spec: np.ndarray) -> np.ndarray:
    """The excess table's factor by speculating requests: 0 without any, proportional past the
    table's last count, else 1."""
    last = SPEC_TABLE_REQS - 1
    return np.where(num_spec > last, num_spec / last, (num_spec > 0).astype(np.float64))


class SpecTerms:
    """ProfileCost.spec_terms_ms over subsets of P prefixes (one ranked order of draft
    positions, `num_spec` [P] speculating requests of each): the request-count lookups are done
    once, so each of the planner's caps pays a few gathers over its own positions (arrays of at
    most P entries, as the planner keeps them)."""

    def __init__(self, profile: ProfileCost, num_spec):
        self.profile = profile
        self.num_spec = np.asarray(num_spec, dtype=np.int64)  # [P]
        k = self.num_spec
        self.propose = profile.propose_ms(k)  # [P] model-free drafter's host time
        self.has_propose = bool(self.propose.any())
        self.in_table = k.max(initial=0) < SPEC_TABLE_REQS
        self.table = self.in_table and profile._chain is not None
        if not self.table:  # first_step(k, 0) + (d - 1) steps, or beyond the table's counts
            self.first = profile._draft(k) + self.propose  # [P]
            self.step = profile._draft(np.maximum(k, 1))  # [P]
        self.excess = profile._excess is not None
        if self.excess and self.in_table:
            # drafts per request at the breaks (whole rows per sequence: integer compares)
            breaks = profile._excess_r[1:-1] - 1.0
            integral = np.all(breaks == np.round(breaks))
            self.segment_rows = breaks.astype(np.int64).tolist() if integral else breaks.tolist()
            self.slope = profile._excess_slope.ravel()  # [SPEC_TABLE_REQS * (J - 1)]
            self.intercept = profile._excess_intercept.ravel()
            self.num_segments = profile._excess_slope.shape[1]

    def __call__(self, taken: np.ndarray, num_draft_rows, depth: int) -> np.ndarray:
        """[m] spec_terms_ms of the prefixes `taken` [m] with their draft rows, at `depth`."""
        p = self.profile
        if self.table and depth <= SPEC_TABLE_DRAFTS:
            t = p._chain[:, depth].take(self.num_spec.take(taken))
            if self.has_propose:
                t = t + self.propose.take(taken)
        elif p._chain is None:
            t = self.first.take(taken) + (depth - 1) * self.step.take(taken)
        else:
            t = p.chain_ms(self.num_spec.take(taken), depth) + self.propose.take(taken)
        if self.excess and self.in_table:
            k = self.num_spec.take(taken)  # [m]
            idx = k * self.num_segments  # [m] the request count's first segment
            for rows_per_req in self.segment_rows:
                idx += num_draft_rows > (k if rows_per_req == 1 else k * rows_per_req)
            t = t + (self.intercept.take(idx) + num_draft_rows * self.slope.take(idx))
        elif self.excess:
            t = t + p.spec_excess_ms(self.num_spec.take(taken), num_draft_rows)
        return t


class CostModel:
    """ProfileCost with per-shape-bucket online correction (see module doc)."""

    def __init__(self, profile: ProfileCost, drafter_prefill: bool = False):
        self.profile = profile
        self.drafter_prefill = drafter_prefill
        num_shapes = len(profile.row_buckets) + 1
        # [NUM_CALIB_CLASSES, num_shapes]: rows by calib_class (AR decode rounds, speculating
        # decode rounds, rounds with prefill chunks)
        self._log_corr = np.zeros((NUM_CALIB_CLASSES, num_shapes))
        self._count = np.zeros((NUM_CALIB_CLASSES, num_shapes))
        # per class: the correction a bucket shrinks toward
        self._global_log_corr = np.zeros(NUM_CALIB_CLASSES)
        self._eff = np.ones((NUM_CALIB_CLASSES, num_shapes))  # exp of the shrunk log correction
        self._eff_list = self._eff.tolist()
        self.num_observations = 0

    @classmethod
    def from_file(cls, path: str | Path, drafter_prefill: bool = False) -> CostModel:
        return cls(ProfileCost.from_file(path), drafter_prefill)

    def correction(self, num_rows, has_spec, has_prefill=False) -> np.ndarray:
        idx = self.profile.bucket_index(num_rows)
        return self._eff[calib_class(has_spec, has_prefill), idx]

    def raw_ms_scalar(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        num_draft_rows=None,
    ) -> float:
        return self.profile.round_ms_scalar(
            num_rows,
            num_kv_tokens,
            draft_depth,
            num_spec,
            drafter_lag_rows,
            num_prefill_rows,
            self.drafter_prefill,
            num_draft_rows=num_draft_rows,
        )

    def predict_ms_scalar(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        num_draft_rows=None,
    ) -> float:
        raw = self.raw_ms_scalar(
            num_rows,
            num_kv_tokens,
            draft_depth,
            num_spec,
            drafter_lag_rows,
            num_prefill_rows,
            num_draft_rows,
        )
        return self.correct_ms_scalar(raw, num_rows, draft_depth > 0, num_prefill_rows > 0)

    def correct_ms_scalar(
        self, raw_ms: float, num_rows: int, has_spec: bool, has_prefill: bool = False
    ) -> float:
        """The calibrated prediction of a shape whose raw_ms_scalar is already known."""
        idx = self.profile.bucket_index_scalar(num_rows)
        return raw_ms * self._eff_list[calib_class(has_spec, has_prefill)][idx]

    def predict_ms(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        num_draft_rows=None,
    ):
        raw = self.profile.round_ms(
            num_rows,
            num_kv_tokens,
            draft_depth,
            num_spec,
            drafter_lag_rows,
            num_prefill_rows,
            self.drafter_prefill,
            num_draft_rows,
        )
        has_prefill = np.asarray(num_prefill_rows) > 0
        return raw * self.correction(num_rows, np.asarray(draft_depth) > 0, has_prefill)

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
        values as predict_ms, via 1-D tables over the few distinct row and request counts (the
        planner's hot path). With the spec-round tables the groups' excess is priced from each
        candidate's own draft rows (predict_ms with num_draft_rows = extra_rows)."""
        p = self.profile
        extra = np.arange(int(extra_rows.max()) + 1)  # [R]
        rows = base_rows + extra
        target = p.prefill_target_ms(rows) if num_prefill_rows else p.padded_target_ms(rows)  # [R]
        fixed = self._spec_fixed(target, base_rows, base_kv_tokens, extra, num_prefill_rows)
        corr = self.correction(rows, True, num_prefill_rows > 0)  # [R]
        num_spec = np.asarray(num_spec)
        lag_rows = np.asarray(lag_rows)
        if p.has_spec_tables:
            draft = p.spec_terms_ms(num_spec, extra_rows, depth)
            if lag_rows.any():
                draft = draft + p.catchup_extra_ms(num_spec, lag_rows)
            return corr[extra_rows] * (fixed[extra_rows] + draft) * p.spec_ratio(num_spec)
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
        self._count *= CALIB_DECAY
        s, b = calib_class(has_spec, has_prefill), self.profile.bucket_index_scalar(num_rows)
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
        self._eff = np.exp(glob + conf * (self._log_corr - glob))
        self._eff_list = self._eff.tolist()

    def confidence(self, num_rows: int, has_spec: bool, has_prefill: bool = False) -> float:
        b = self.profile.bucket_index_scalar(num_rows)
        c = self._count[calib_class(has_spec, has_prefill), b]
        return float(c / (c + CALIB_PRIOR_COUNT))
