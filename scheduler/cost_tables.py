"""Lookup tables of profiled cost curves, and the two forms in which the cost formulas read them.

A cost formula of the profile is written once, against a `Form`: the array form prices numpy
arrays of round shapes (broadcast), the scalar form one shape in plain Python numbers, which is
what the scheduler and the policy ask several times per round and where array overhead would
dominate. Both forms read the same tables, so they give the same numbers.
"""

from __future__ import annotations

import bisect
import math
import types

import numpy as np

TABLE_ROWS = 16384  # row counts with a precomputed cost; larger ones use the linear tail
SPEC_TABLE_REQS = 1024  # speculating-request counts with precomputed spec-round terms
SPEC_TABLE_DRAFTS = 32  # drafts per request with a precomputed proposal cost (spec depth <= 32)


def tail_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """Slope of the last segment, never below 0 (0 for a single point: a flat curve). More rows
    never cost less: a last segment that falls within the timing noise (a launch-bound eager
    forward measured slightly faster at more rows) would otherwise price a large catch-up
    below zero."""
    if len(xs) < 2:
        return 0.0
    return max(float((ys[-1] - ys[-2]) / (xs[-1] - xs[-2])), 0.0)


def interp_linear_tail(x, xs: np.ndarray, ys: np.ndarray):
    """Piecewise-linear interpolation that continues the last segment past the end and is
    clamped to the first point below the start."""
    y = np.interp(x, xs, ys)
    slope = tail_slope(xs, ys)
    return np.where(x > xs[-1], ys[-1] + (np.asarray(x) - xs[-1]) * slope, y)


class Curve:
    """A profiled cost over integer row counts: a table below TABLE_ROWS, a linear tail past."""

    def __init__(self, table: np.ndarray, slope: float):
        self.table = table  # [TABLE_ROWS] cost of each row count
        self.table_list = table.tolist()
        self.end = float(table[-1])
        self.slope = slope

    @classmethod
    def from_points(cls, xs: np.ndarray, ys: np.ndarray) -> Curve:
        table = interp_linear_tail(np.arange(TABLE_ROWS), xs, ys)
        return cls(table, tail_slope(xs, ys))

    def _tail(self, rows):
        return self.end + (rows - TABLE_ROWS + 1) * self.slope

    def __call__(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.max(initial=0) < TABLE_ROWS:
            return self.table[rows]  # the common case: one gather
        inside = self.table[np.minimum(rows, TABLE_ROWS - 1)]
        return np.where(rows < TABLE_ROWS, inside, self._tail(rows))

    def scalar(self, rows: int) -> float:
        return self.table_list[rows] if rows < TABLE_ROWS else self._tail(rows)


class CountTable:
    """A value by count (requests, rows), flat outside the table: the count is clamped to it."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values)  # [num_counts]
        self.values_list = self.values.tolist()
        self.last = len(self.values) - 1

    def __call__(self, counts):
        counts = np.asarray(counts, dtype=np.int64)
        if counts.min(initial=0) >= 0 and counts.max(initial=0) <= self.last:
            return self.values[counts]  # the common case: one gather (np.clip costs more)
        return self.values[np.clip(counts, 0, self.last)]

    def scalar(self, count: int):
        if 0 <= count <= self.last:  # (chained compares: cheaper than min(max(..)))
            return self.values_list[count]
        return self.values_list[0 if count < 0 else self.last]


class Table:
    """Values at whole indices of a 1-D or 2-D table (indices in range)."""

    def __init__(self, values: np.ndarray):
        self.values = np.asarray(values)
        self.flat = self.values.ravel()
        self.nested = self.values.tolist()
        self.width = self.values.shape[-1]

    def __call__(self, i, j=None):
        return self.flat.take(i if j is None else i * self.width + j)

    def scalar(self, i: int, j: int | None = None):
        return self.nested[i] if j is None else self.nested[i][j]


def _same(x):
    return x


def _select(cond, a, b):
    return a if cond else b


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _zero(*like) -> float:
    return 0.0


def _zeros(*like) -> np.ndarray:
    return np.zeros(np.broadcast(*map(np.asarray, like)).shape)


def _any(x) -> bool:
    return np.count_nonzero(x) > 0  # (a few times cheaper than np.any or x.any())


def _search(table: Table, x):
    return np.searchsorted(table.values, x, side="right")


def _search_scalar(table: Table, x) -> int:
    return bisect.bisect_right(table.nested, x)


# The operations of the formulas by form: numpy's on arrays (the formulas' array inputs are numpy
# arrays or scalars), Python's on one shape. `trunc` makes a row count whole (array lookups
# truncate on their own); `zeros(*like)` is 0 in the broadcast shape of its arguments;
# `search(table, x)` the insertion point right of x in a sorted 1-D Table.
_ARRAY_OPS = {
    "max": np.maximum,
    "min": np.minimum,
    "clip": np.clip,
    "ceil": np.ceil,
    "trunc": _same,
    "where": np.where,
    "any": _any,
    "zeros": _zeros,
    "search": _search,
}
_SCALAR_OPS = {
    "max": max,
    "min": min,
    "clip": _clip,
    "ceil": math.ceil,
    "trunc": int,
    "where": _select,
    "any": bool,
    "zeros": _zero,
    "search": _search_scalar,
}


class Form:
    """The tables of a profile and the operations of its cost formulas, in one form (see module
    doc): every table is a lookup under its name (its array call, or its `scalar` method), every
    operation is numpy's or Python's. `scalar` tells which."""

    def __init__(self, tables: dict, scalar: bool):
        self.scalar = scalar
        for name, op in (_SCALAR_OPS if scalar else _ARRAY_OPS).items():
            setattr(self, name, op)
        for name, table in tables.items():
            lookup = table if table is None or not scalar else table.scalar
            setattr(self, name, lookup)


def complete_grid(points, min_second: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def over_requests(counts: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """[K, J] values at the measured request counts -> [SPEC_TABLE_REQS, J] at every count,
    log-linear between them and flat outside (row 0 copies row 1)."""
    k = np.arange(1, SPEC_TABLE_REQS, dtype=np.float64)
    out = np.empty((SPEC_TABLE_REQS, grid.shape[1]))
    for j in range(grid.shape[1]):
        out[1:, j] = np.interp(np.log(k), np.log(counts), grid[:, j])
    out[0] = out[1]
    return out


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
    curve(2 cap) - curve(cap). The passes replay graphs of whole buckets, so reading the curve
    at the rows as they are would price uneven prompts between the measured buckets."""
    rows = np.asarray(rows, dtype=np.int64)
    full = np.maximum(-(-rows // cap) - 1, 0)  # full passes before the last
    last = wide_pass_padded_rows(rows - full * cap, cap, buckets)
    per_pass = float(curve(np.array([2 * cap]))[0] - curve(np.array([cap]))[0])
    return curve(last) + full * per_pass


def keyword_twin(method, name: str, **kwdefaults):
    """`method` under another name with other defaults for keyword-only parameters: the same
    code object, so a one-shape entry point such as round_ms_scalar (round_ms, scalar=True)
    adds no forwarding call of its own, which would cost about as much as an AR round's whole
    price on the scheduler's path. Its doc names what it is."""
    twin = types.FunctionType(
        method.__code__, method.__globals__, name, method.__defaults__, method.__closure__
    )
    twin.__kwdefaults__ = {**(method.__kwdefaults__ or {}), **kwdefaults}
    twin.__qualname__ = method.__qualname__.rsplit(".", 1)[0] + "." + name
    twin.__module__ = method.__module__
    twin.__annotations__ = method.__annotations__
    settings = ", ".join(f"{key}={value!r}" for key, value in kwdefaults.items())
    twin.__doc__ = f"{method.__name__} with {settings} by default."
    return twin
