"""Latencies per part of a prefix-caching workload, from the tags its requests carry.

- `ttft_split`: the requests that find nothing to reuse against those that may: a
  conversation's first turn against its later ones, a group's first request against the
  group's later ones. A server with prefix caching shows its gain as `later` below `first`.
- `by_turn`: every turn index of a multi-turn run (prompts grow turn by turn).
Each part gives its request count, mean prompt tokens (the server's usage counts), TTFT and E2E.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loadtests import stats
from loadtests.records import RequestRecord


def part_summary(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    prompts = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens]
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        "ttft": stats.summarize(r.ttft_s for r in ok if r.ttft_s is not None),
        "e2e": stats.summarize(r.e2e_s for r in ok),
    }


def split_by(
    records: Sequence[RequestRecord], key: Callable[[RequestRecord], str | None]
) -> dict[str, dict]:
    """One summary per key value, in order of first appearance; None keys are left out."""
    parts: dict[str, list[RequestRecord]] = {}
    for r in records:
        k = key(r)
        if k is not None:
            parts.setdefault(k, []).append(r)
    return {k: part_summary(rs) for k, rs in parts.items()}


def _first_or_later(tag: str, first_value: int) -> Callable[[RequestRecord], str | None]:
    def key(r: RequestRecord) -> str | None:
        value = r.extra.get(tag)
        return None if value is None else "first" if value == first_value else "later"

    return key


def ttft_split(records: Sequence[RequestRecord], workload: str) -> dict[str, dict]:
    if workload == "multi-turn":
        key = _first_or_later("turn", 1)
    elif workload == "shared-prefix":
        key = _first_or_later("group_rank", 0)
    else:
        raise ValueError(f"no split for workload {workload!r}")
    parts = split_by(records, key)
    return {k: parts[k] for k in ("first", "later") if k in parts}


def by_turn(records: Sequence[RequestRecord]) -> dict[str, dict]:
    ordered = sorted((r for r in records if "turn" in r.extra), key=lambda r: r.extra["turn"])
    return split_by(ordered, lambda r: str(r.extra["turn"]))
