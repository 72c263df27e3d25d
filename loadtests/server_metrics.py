"""What the server's `/metrics` says about a run: deltas of its counters between two scrapes.

Names follow vLLM's schema under a prefix (`hipfire:` for this project's server, `vllm:` for
vLLM; the prefix is detected). Speculative decoding, after vLLM's definitions:
  acceptance rate   = accepted draft tokens / drafted tokens
  acceptance length = 1 + accepted draft tokens / drafts  (tokens per target forward of a
                      speculating request, the bonus/correction token included)
Round-level figures (this project's scheduler only): mean rows and speculating requests per round
from the `round_rows` / `round_spec_requests` histograms, and the route mix (share of
request-rounds decoded speculatively, plainly, or prefilling) from `round_route_total`.
Prefix caching, after vLLM's counters (prompt tokens looked up in the cache, and those found):
  hit rate = prefix_cache_hits / prefix_cache_queries over the run
A server without these counters gets `prefix_cache_counters: False` and no figures, never 0.
"""

from __future__ import annotations

import httpx

from loadtests.promtext import Snapshot

PREFIXES = ("hipfire", "vllm", "sglang")
# (queries, hits) counter names under a prefix: vLLM's, then the older `gpu_` ones of vLLM.
PREFIX_CACHE_COUNTERS = (
    ("prefix_cache_queries_total", "prefix_cache_hits_total"),
    ("gpu_prefix_cache_queries_total", "gpu_prefix_cache_hits_total"),
)


def metrics_url(base_url: str) -> str:
    """The server root's /metrics for an API root such as http://host:8000/v1."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


async def scrape(http: httpx.AsyncClient, url: str) -> Snapshot | None:
    """One scrape, or None when the server has no usable /metrics."""
    try:
        resp = await http.get(url)
        if resp.status_code != 200:
            return None
        return Snapshot.from_text(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


def detect_prefix(snap: Snapshot) -> str | None:
    for p in PREFIXES:
        if snap.has(f"{p}:generation_tokens_total") or snap.has(f"{p}:num_requests_running"):
            return p
    return None


def _hist_mean(before: Snapshot, after: Snapshot, name: str) -> float | None:
    count = after.total(f"{name}_count") - before.total(f"{name}_count")
    if count <= 0:
        return None
    return (after.total(f"{name}_sum") - before.total(f"{name}_sum")) / count


def summarize_delta(before: Snapshot | None, after: Snapshot | None) -> dict | None:
    """Counter deltas of one run as a flat dict (None when the server exposes no metrics)."""
    if before is None or after is None:
        return None
    prefix = detect_prefix(after)
    if prefix is None:
        return None

    def d(name: str, **match: str) -> float:
        full = f"{prefix}:{name}"
        return after.total(full, **match) - before.total(full, **match)

    out: dict = {
        "prefix": prefix,
        "generation_tokens": d("generation_tokens_total"),
        "prompt_tokens": d("prompt_tokens_total"),
        "requests_succeeded": d("request_success_total"),
    }
    drafts = d("spec_decode_num_drafts_total")
    draft_tokens = d("spec_decode_num_draft_tokens_total")
    accepted = d("spec_decode_num_accepted_tokens_total")
    out["spec_drafts"] = drafts
    out["spec_draft_tokens"] = draft_tokens
    out["spec_accepted_tokens"] = accepted
    out["acceptance_rate"] = accepted / draft_tokens if draft_tokens > 0 else None
    out["acceptance_length"] = 1.0 + accepted / drafts if drafts > 0 else None
    per_pos_name = f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total"
    if drafts > 0 and after.has(per_pos_name):
        pos_after = after.by_label(per_pos_name, "position")
        pos_before = before.by_label(per_pos_name, "position")
        out["acceptance_per_position"] = {
            p: (v - pos_before.get(p, 0.0)) / drafts
            for p, v in sorted(pos_after.items(), key=lambda kv: int(kv[0] or 0))
        }
    out["rows_per_round"] = _hist_mean(before, after, f"{prefix}:round_rows")
    out["spec_requests_per_round"] = _hist_mean(before, after, f"{prefix}:round_spec_requests")
    out["predicted_round_ms"] = _ms(_hist_mean(before, after, f"{prefix}:round_predicted_seconds"))
    out["measured_round_ms"] = _ms(_hist_mean(before, after, f"{prefix}:round_measured_seconds"))
    routes_after = after.by_label(f"{prefix}:round_route_total", "route")
    routes_before = before.by_label(f"{prefix}:round_route_total", "route")
    routes = {r: v - routes_before.get(r, 0.0) for r, v in routes_after.items()}
    num_routes = sum(routes.values())
    out["route_mix"] = (
        {r: v / num_routes for r, v in sorted(routes.items())} if num_routes > 0 else None
    )
    out["policy_switches"] = d("policy_switches_total")
    out.update(prefix_cache_delta(before, after, prefix))
    return out


def prefix_cache_delta(before: Snapshot, after: Snapshot, prefix: str) -> dict:
    """Prefix-cache queries, hits (tokens) and hit rate of a run; None where not exposed."""
    for queries_name, hits_name in PREFIX_CACHE_COUNTERS:
        q_full, h_full = f"{prefix}:{queries_name}", f"{prefix}:{hits_name}"
        if after.has(q_full) and after.has(h_full):
            queries = after.total(q_full) - before.total(q_full)
            hits = after.total(h_full) - before.total(h_full)
            return {
                "prefix_cache_counters": True,
                "prefix_cache_queries": queries,
                "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
            }
    return {
        "prefix_cache_counters": False,
        "prefix_cache_queries": None,
        "prefix_cache_hits": None,
        "prefix_cache_hit_rate": None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds
