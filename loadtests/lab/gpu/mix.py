"""Route-mix helpers the benchmark's runs, report and plots share: labels of the all-AR points
and the share of request-rounds that speculated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

AR = "all-ar"
ANY = "-"  # the cohort and drafter of all-AR points: AR uses neither


def mean_mix(mixes: Sequence[dict]) -> dict:
    keys = sorted({k for m in mixes for k in m})
    return {k: float(np.mean([m.get(k, 0.0) for m in mixes])) for k in keys} if mixes else {}


def decode_mix(row: dict) -> dict:
    """The route mix of full-live rounds, or of all rounds where the point had none."""
    full = row["route_mix_full_live"]
    return full if sum(full.values()) > 0 else row["route_mix"]


def spec_share(mix: dict) -> float | None:
    """Share of decoding request-rounds that speculated."""
    decoding = mix.get("S", 0.0) + mix.get("A", 0.0)
    return mix.get("S", 0.0) / decoding if decoding else None
