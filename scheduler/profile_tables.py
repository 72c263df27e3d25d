"""A cost profile JSON (the format `hipfire-serve profile` writes) read into lookup tables.

`ProfileTables` holds what the profile measured, each curve tabulated once over every row or
request count the scheduler prices: the target's dense forward by rows (attention is not in
those numbers: the KV term prices it), the drafter's steps, proposals and catch-ups, the
speculating rounds' excess over AR rows, and the engine's factors and host times around
rounds. Fields a profile lacks (older profiles) fall back to values that leave the other
terms as they are. The prices themselves are `ProfileCost`'s (scheduler/profile_cost.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from scheduler.cost_tables import (
    SPEC_TABLE_DRAFTS,
    SPEC_TABLE_REQS,
    TABLE_ROWS,
    CountTable,
    Curve,
    Form,
    Table,
    complete_grid,
    over_requests,
    wide_catchup_ms,
)


def _by_count(points, default: float, lo: float = 0.0, hi: float = np.inf) -> CountTable:
    """[m, 2] (count, value) points -> every count below TABLE_ROWS, linear between the
    points, flat outside them, values within [lo, hi] (no points: `default`)."""
    pts = np.asarray(points or [[1, default]], dtype=np.float64)
    return CountTable(np.interp(np.arange(TABLE_ROWS), pts[:, 0], np.clip(pts[:, 1], lo, hi)))


def _curve_or(points, fallback: Curve) -> Curve:
    """The curve through [m, 2] (rows, ms) points, flat below the first; `fallback` without."""
    pts = np.asarray(points or [], dtype=np.float64).reshape(-1, 2)
    return Curve.from_points(pts[:, 0], pts[:, 1]) if len(pts) else fallback


def excess_table(target: Curve, spec_rows_ms) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (rows per sequence r [J], excess ms [SPEC_TABLE_REQS, J]) from `spec_rows_ms`
    ([k, r, ms]: whole rounds of k speculating sequences of r rows each at the reference
    context, the KV term subtracted): what verifying groups costs beyond AR rows,
    excess(k, r) = spec_rows_ms(k, r) - target(k * r), 0 at r = 1. Made non-decreasing in r and
    k: with rows padded to a bucket a round must not get cheaper as drafts are added, so a
    measured excess below a shallower or smaller group's is noise. Log-linear in k between the
    profiled counts, proportional to k outside them. None without the table."""
    counts, rows_per_seq, grid = complete_grid(spec_rows_ms or [], 1.0)
    r = np.concatenate([[1.0], rows_per_seq])  # [J] r = 1: AR rows, no excess
    if not len(counts) or not len(rows_per_seq):
        return r, None
    ar = target(np.rint(counts[:, None] * rows_per_seq[None, :]))  # [K, J - 1]
    excess = np.concatenate([np.zeros((len(counts), 1)), grid - ar], axis=1)  # [K, J]
    excess = np.maximum.accumulate(np.maximum.accumulate(excess, axis=1), axis=0)
    table = over_requests(counts, excess)  # [SPEC_TABLE_REQS, J]
    k = np.arange(SPEC_TABLE_REQS, dtype=np.float64)[:, None]  # [SPEC_TABLE_REQS, 1]
    # outside the profiled counts the excess per speculating request stays
    table = np.where(k < counts[0], excess[0] * k / counts[0], table)
    table = np.where(k > counts[-1], excess[-1] * k / counts[-1], table)
    return r, table


def chain_table(draft_step: Curve, propose_ms) -> np.ndarray | None:
    """[SPEC_TABLE_REQS, SPEC_TABLE_DRAFTS + 1] a draft model's whole proposal by (speculating
    requests k, drafts d) from `propose_ms` ([k, d, ms]: one proposal right after a verified
    round, its first step catching up the usual 1-2 rows per request), or None. Linear in d
    between the profiled drafts, proportional below the shallowest, plus chain steps past the
    deepest; log-linear in k, plus d steps' growth of the step curve past the largest count;
    non-decreasing in both."""
    counts, drafts, grid = complete_grid(propose_ms or [], 0.0)
    if not len(counts) or not len(drafts):
        return None
    grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=1), axis=0)
    by_reqs = over_requests(counts, grid)  # [SPEC_TABLE_REQS, J]
    k = np.arange(SPEC_TABLE_REQS)
    step = draft_step(np.maximum(k, 1))  # [SPEC_TABLE_REQS] one chain step
    grow = np.maximum(step - draft_step(int(counts[-1])), 0.0)[:, None] * drafts[None, :]
    by_reqs = np.where((k > counts[-1])[:, None], by_reqs + grow, by_reqs)
    by_reqs = np.maximum.accumulate(by_reqs, axis=0)
    d = np.arange(SPEC_TABLE_DRAFTS + 1, dtype=np.float64)
    if len(drafts) > 1:
        j = np.clip(np.searchsorted(drafts, d, side="right") - 1, 0, len(drafts) - 2)
        w = np.clip((d - drafts[j]) / (drafts[j + 1] - drafts[j]), 0.0, 1.0)
        table = by_reqs[:, j] * (1.0 - w) + by_reqs[:, j + 1] * w
    else:
        table = np.repeat(by_reqs, len(d), axis=1)
    table = np.where(d < drafts[0], by_reqs[:, :1] * d / drafts[0], table)
    deeper = by_reqs[:, -1:] + (d - drafts[-1]) * step[:, None]
    return np.where(d > drafts[-1], deeper, table)


class ProfileTables:
    """The uncorrected cost curves of a profile JSON, tabulated (see module doc)."""

    def __init__(self, profile: dict):
        target = profile["target"]
        rows_ms = np.asarray(target["rows_ms"], dtype=np.float64)  # [num_points, 2]
        self.name = profile.get("name", "profile")
        self.target_rows = rows_ms[:, 0]  # [num_points]
        self.target_ms_points = rows_ms[:, 1]  # [num_points]
        # one KV scan per sequence: bytes per token over the read bandwidth
        self.kv_ms_per_token = (
            target["kv_bytes_per_token"] / (target["kv_read_TBps_assumed"] * 1e12) * 1e3
        )
        draft = profile.get("draft_model") or {}
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
        # A proposal's drafts read their request's draft KV: ms per draft per token of context
        # past the proposals' reference `context_len` (absent: priced at that context).
        self.draft_kv_ms_per_token = float(draft.get("kv_ms_per_token") or 0.0)
        self.draft_context_len = float(draft.get("context_len") or 0.0)
        # catch-up in passes of a few rows per request (absent: one forward of all rows)
        self.catchup_rows_per_pass = int(draft.get("catchup_rows_per_pass") or 0)
        self.max_catchup_passes = int(draft.get("max_catchup_passes") or 1)
        # a model-free drafter's proposal time on the host (prompt lookup), by speculating
        # requests (absent: 0)
        lookup = (profile.get("drafter_host") or {}).get("propose_ms")
        self.propose_table = _by_count(lookup, 0.0)
        # The engine's host work around a speculating round (planning, the scheduler's update,
        # output collection) adds to its period, since such a round cannot run ahead (its
        # successor's drafts need its accepted tokens): by decoding requests (absent: 0).
        self.spec_host_table = _by_count(target.get("spec_host_ms_per_round"), 0.0)
        # Speculating rounds as the engine runs them over the sum of their terms (which are
        # measured piece by piece, rounds alone and proposals alone), by speculating requests
        # (absent: 1).
        self.spec_ratio_table = _by_count(target.get("spec_round_ratio"), 1.0, 0.5, 3.0)
        # The first AR round after a speculating one starts from an idle pipeline: what it
        # costs beyond a steady AR round, by decoding requests (absent: 0).
        self.restart_table = _by_count(target.get("ar_restart_ms"), 0.0)
        # An AR-only decode round runs ahead: the host's work between rounds hides behind the
        # device's. Period of rounds run ahead over the round alone, by rows (absent: 1).
        self.ahead_ratio_table = _by_count(target.get("ar_ahead_ratio"), 1.0, 0.05, 1.0)
        # Graph buckets are the profiled row counts: these are the shapes that were measured.
        self.row_buckets = np.asarray(self.target_rows, dtype=np.int64)  # [num_points]
        self.target_curve = Curve.from_points(self.target_rows, self.target_ms_points)
        # Rounds with prefill chunks run eagerly, bound by launching their kernels more than by
        # their rows: priced by the profile's prefill rounds where it has them
        # (`prefill_rows_ms`), flat below the fewest rows measured.
        self.prefill_curve = _curve_or(target.get("prefill_rows_ms"), self.target_curve)
        self.draft_curve = Curve.from_points(self.draft_rows, self.draft_ms_points)
        # A catch-up past the passes is one eager forward (the passes' graphs hold a few rows
        # per request): launch-bound, so priced at the measured whole-forward times
        # (`catchup_rows_ms`), flat below the fewest rows measured, not at the graphed chain
        # step of as many rows. A graphed drafter runs it in passes of `catchup_pass_rows`,
        # the last replayed at its row bucket (`catchup_pass_buckets`): wide_catchup_ms.
        self.eager_curve = _curve_or(draft.get("catchup_rows_ms"), self.draft_curve)
        buckets = np.asarray(draft.get("catchup_pass_buckets") or [], dtype=np.int64)
        if draft.get("catchup_rows_ms") and len(buckets):
            cap = int(draft.get("catchup_pass_rows") or buckets[-1])
            table = wide_catchup_ms(self.eager_curve, np.arange(TABLE_ROWS), cap, buckets)
            self.eager_curve = Curve(table, (table[-1] - table[-1 - cap]) / cap)
        table_rows = np.arange(TABLE_ROWS)
        # target cost at the graph bucket of each row count (eager past the largest bucket)
        self.padded_curve = Curve(
            self.target_curve(self.bucket(table_rows)), self.target_curve.slope
        )
        # shape-bucket id by rows: len(row_buckets) for eager shapes (past the table too)
        bucket_ids = np.searchsorted(self.row_buckets, table_rows)  # [TABLE_ROWS]
        self.shape_bucket = CountTable(np.append(bucket_ids, len(self.row_buckets)))
        self.bucket_index_list = bucket_ids.tolist()
        self._read_spec_tables(target, draft)
        self._make_forms()

    def _read_spec_tables(self, target: dict, draft: dict) -> None:
        """The tables of speculating rounds as served (excess_table, chain_table); None in
        older profiles, whose speculating rounds are priced by the step curves alone."""
        r, excess = excess_table(self.target_curve, target.get("spec_rows_ms"))
        self.excess_rows_per_seq = Table(r)  # [J]
        self.excess_width = Table(np.diff(r))  # [J - 1] (an empty table: unused)
        self.excess = None if excess is None else Table(excess)
        if excess is not None:
            # per request count k the excess is piecewise linear in the draft rows D, with
            # breaks at D = k * (r_j - 1): intercept + D * slope on segment j (the planner's
            # form, SpecTerms), [SPEC_TABLE_REQS, J - 1] each
            k = np.maximum(np.arange(SPEC_TABLE_REQS), 1)[:, None]  # (row 0 is all zero)
            self.excess_slope = np.diff(excess, axis=1) / (k * np.diff(r))
            self.excess_intercept = excess[:, :-1] - k * (r[:-1] - 1.0) * self.excess_slope
        chain = chain_table(self.draft_curve, draft.get("propose_ms"))
        self.chain = None if chain is None else Table(chain)
        self.has_spec_tables = self.excess is not None or self.chain is not None

    def _make_forms(self) -> None:
        """The lookups of every table in both forms (ProfileCost's formulas read them)."""
        tables = {
            "target": self.target_curve,
            "padded": self.padded_curve,
            "prefill": self.prefill_curve,
            "draft": self.draft_curve,
            "eager": self.eager_curve,
            "ahead_ratio": self.ahead_ratio_table,
            "propose": self.propose_table,
            "spec_host": self.spec_host_table,
            "spec_ratio": self.spec_ratio_table,
            "shape_bucket": self.shape_bucket,
            "chain": self.chain,
            "excess": self.excess,
            "excess_r": self.excess_rows_per_seq,
            "excess_width": self.excess_width,
        }
        self.arrays, self.scalars = Form(tables, scalar=False), Form(tables, scalar=True)

    @classmethod
    def from_file(cls, path: str | Path):
        with open(path) as f:
            return cls(json.load(f))

    def bucket(self, num_rows):
        """Padded row count for graph replay; rows above the largest bucket run eagerly
        (returned unpadded). Works on scalars and arrays."""
        idx = np.searchsorted(self.row_buckets, num_rows)
        idx_c = np.minimum(idx, len(self.row_buckets) - 1)
        return np.where(idx < len(self.row_buckets), self.row_buckets[idx_c], num_rows)
