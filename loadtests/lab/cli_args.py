"""Comma-separated command-line values shared by the benchmarks and probes."""

from __future__ import annotations


def int_tuple(text: str) -> tuple[int, ...]:
    """ "1,2, 4" -> (1, 2, 4); empty items are skipped, a non-integer raises ValueError."""
    return tuple(int(x) for x in text.split(",") if x.strip())
