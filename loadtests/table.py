"""Plain-text tables for the terminal: one row per run, and side-by-side comparisons."""

from __future__ import annotations

from collections.abc import Sequence

from loadtests.results import dig


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]  # fmt: skip

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def run_key(run: dict) -> str:
    if run["mode"] in ("refill", "multi-turn"):
        return f"C={run['concurrency']}"
    rate = run.get("rate")
    return f"rate={'inf' if rate in (None, float('inf')) else fmt(rate, 2)}"


def runs_table(report: dict) -> str:
    """The per-run summary printed after a load run."""
    refill = report["mode"] == "refill"
    headers = ["run", "reqs", "ok", "out tok"]
    headers += ["full-live tok/s", "refill tok/s"] if refill else ["tok/s", "req/s"]
    headers += ["TTFT p50/p99 ms", "ITL p50/p99 ms", "TPOT p50 ms", "E2E p50/p99 ms"]
    has_goodput = any(r.get("goodput") for r in report["runs"])
    has_fairness = any(r.get("fairness") is not None for r in report["runs"])
    has_server = any(r.get("server") for r in report["runs"])
    if has_goodput:
        headers.append("goodput req/s")
    if has_fairness:
        headers.append("Jain")
    if has_server:
        headers += ["accept len", "spec req/rnd", "rows/rnd", "route S/A/P", "prefix hit"]
    rows = []
    for run in report["runs"]:
        row = [run_key(run), str(run["num_requests"]), str(run["num_ok"]),
               str(run["num_output_tokens"])]  # fmt: skip
        if refill:
            row += [fmt(run["full_live_tokens_per_s"]), fmt(run["refill_tokens_per_s"])]
        else:
            row += [fmt(run["refill_tokens_per_s"]), fmt(run["requests_per_s"], 2)]
        for lat in ("ttft", "itl"):
            row.append(f"{fmt(run[lat]['p50_ms'])}/{fmt(run[lat]['p99_ms'])}")
        row.append(fmt(run["tpot"]["p50_ms"], 2))
        row.append(f"{fmt(run['e2e']['p50_ms'], 0)}/{fmt(run['e2e']['p99_ms'], 0)}")
        if has_goodput:
            row.append(fmt(dig(run, ("goodput", "requests_per_s")), 2))
        if has_fairness:
            row.append(fmt(run.get("fairness"), 3))
        if has_server:
            srv = run.get("server") or {}
            mix = srv.get("route_mix") or {}
            row += [
                fmt(srv.get("acceptance_length"), 2),
                fmt(srv.get("spec_requests_per_round"), 1),
                fmt(srv.get("rows_per_round"), 1),
                "/".join(fmt(mix.get(k, 0.0), 2) for k in ("spec", "ar", "prefill"))
                if mix
                else "-",
                prefix_hit(srv),
            ]
        rows.append(row)
    return render(headers, rows)


def prefix_hit(server: dict | None) -> str:
    """The run's prefix-cache hit rate; 'absent' when the server exposes no such counters."""
    if not server:
        return "-"
    if not server.get("prefix_cache_counters"):
        return "absent"
    return fmt(server.get("prefix_cache_hit_rate"), 3)


def _part_row(key: str, part: str, p: dict) -> list[str]:
    t = p["ttft"]
    return [key, part, str(p["num_requests"]), fmt(p["mean_prompt_tokens"], 0),
            "/".join(fmt(t[q]) for q in ("p50_ms", "p90_ms", "p99_ms")),
            fmt(p["e2e"]["p50_ms"], 0)]  # fmt: skip


def parts_table(report: dict) -> str:
    """TTFT per part of a prefix-caching workload: first vs later requests, and per turn."""
    headers = ["run", "part", "reqs", "prompt tok", "TTFT p50/p90/p99 ms", "E2E p50 ms"]
    rows = []
    for run in report["runs"]:
        key = run_key(run)
        num_ok = run["num_ok"]
        whole = {
            "num_requests": run["num_requests"],
            "mean_prompt_tokens": run["num_prompt_tokens"] / num_ok if num_ok else None,
            "ttft": run["ttft"],
            "e2e": run["e2e"],
        }
        rows.append(_part_row(key, "all", whole))
        for part, p in (run.get("ttft_split") or {}).items():
            rows.append(_part_row(key, part, p))
        for turn, p in (run.get("turns") or {}).items():
            rows.append(_part_row(key, f"turn {turn}", p))
    return render(headers, rows)
