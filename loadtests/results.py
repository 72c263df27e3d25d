"""Turns the records of one run into its summary, and a report into JSON and CSV files."""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from loadtests import stats
from loadtests.records import RequestRecord
from loadtests.windows import throughput, tokens_per_s_over_time

LATENCIES = ("ttft", "itl", "tpot", "e2e")


def summarize_run(
    records: Sequence[RequestRecord],
    *,
    mode: str,
    concurrency: int | None = None,
    rate: float | None = None,
    slo: dict[str, float] | None = None,
    server: dict | None = None,
) -> dict:
    """One run's figures; latencies in ms, throughput in tokens/s."""
    ok = [r for r in records if r.ok]
    tp = throughput(records, concurrency if mode == "refill" else None)
    errors = Counter(r.error for r in records if not r.ok)
    run: dict = {
        "mode": mode,
        "concurrency": concurrency,
        "rate": rate,
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": [f"{n}x {msg}" for msg, n in errors.most_common(5)],
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in ok),
        "num_output_tokens": tp.num_output_tokens,
        "token_count_source": Counter(r.token_count_source for r in ok).most_common(1)[0][0]
        if ok
        else None,
        "duration_s": tp.duration_s,
        "refill_tokens_per_s": tp.refill_tokens_per_s,
        "full_live_tokens_per_s": tp.full_live_tokens_per_s,
        "full_live_s": tp.full_live_s,
        "full_live_tokens": tp.full_live_tokens,
        "num_full_live_windows": tp.num_windows,
        "requests_per_s": len(ok) / tp.duration_s if tp.duration_s > 0 else 0.0,
        "ttft": stats.summarize(r.ttft_s for r in ok if r.ttft_s is not None),
        "itl": stats.summarize(gap for r in ok for gap in r.itls_s),
        "tpot": stats.summarize(r.tpot_s for r in ok if r.tpot_s is not None),
        "e2e": stats.summarize(r.e2e_s for r in ok),
    }
    if slo:
        good = stats.goodput(records, slo, tp.duration_s)
        run["goodput"] = {
            "slo_ms": {k: v * 1e3 for k, v in slo.items()},
            "num_good": good.num_good,
            "good_fraction": good.good_fraction,
            "requests_per_s": good.requests_per_s,
        }
    tenant_tps = stats.per_tenant_tokens_per_s(records, tp.duration_s)
    run["tenants"] = {
        name: {
            "tokens_per_s": tps,
            "num_requests": sum(r.tenant == name for r in records),
            "num_output_tokens": sum(r.num_output_tokens for r in ok if r.tenant == name),
        }
        for name, tps in tenant_tps.items()
    }
    run["fairness"] = stats.jain_index(list(tenant_tps.values())) if len(tenant_tps) > 1 else None
    run["server"] = server
    run["timeline"] = [[round(t, 4), round(v, 2)] for t, v in tokens_per_s_over_time(records)]
    return run


# Columns of the per-run CSV: (header, path into the run dict).
CSV_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mode", ("mode",)),
    ("concurrency", ("concurrency",)),
    ("rate", ("rate",)),
    ("num_requests", ("num_requests",)),
    ("num_ok", ("num_ok",)),
    ("num_output_tokens", ("num_output_tokens",)),
    ("num_prompt_tokens", ("num_prompt_tokens",)),
    ("duration_s", ("duration_s",)),
    ("full_live_tokens_per_s", ("full_live_tokens_per_s",)),
    ("refill_tokens_per_s", ("refill_tokens_per_s",)),
    ("requests_per_s", ("requests_per_s",)),
    *(
        (f"{lat}_{q}", (lat, q))
        for lat in LATENCIES
        for q in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")
    ),
    ("goodput_requests_per_s", ("goodput", "requests_per_s")),
    ("goodput_fraction", ("goodput", "good_fraction")),
    ("fairness", ("fairness",)),
    ("server_generation_tokens", ("server", "generation_tokens")),
    ("acceptance_length", ("server", "acceptance_length")),
    ("acceptance_rate", ("server", "acceptance_rate")),
    ("rows_per_round", ("server", "rows_per_round")),
    ("spec_requests_per_round", ("server", "spec_requests_per_round")),
    ("prefix_cache_hit_rate", ("server", "prefix_cache_hit_rate")),
    *(
        (f"ttft_{part}_{q}", ("ttft_split", part, "ttft", q))
        for part in ("first", "later")
        for q in ("p50_ms", "p90_ms", "p99_ms")
    ),
)


def dig(run: dict, path: Sequence[str]):
    value = run
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def write_runs_csv(report: dict, path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["label"] + [h for h, _ in CSV_COLUMNS] + ["route_mix"])
        for run in report["runs"]:
            mix = dig(run, ("server", "route_mix")) or {}
            writer.writerow(
                [report["label"]]
                + [_cell(dig(run, p)) for _, p in CSV_COLUMNS]
                + [" ".join(f"{k}={v:.3f}" for k, v in mix.items())]
            )


def write_requests_csv(runs: Sequence[tuple[dict, Sequence[RequestRecord]]], path: Path) -> None:
    """One row per request: its run, tenant, latencies (ms), token counts and the workload's
    tags (a shared-prefix request's group; a multi-turn request's conversation and turn)."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["concurrency", "rate", "req_id", "prompt_id", "tenant", "ok", "submit_s",
             "ttft_ms", "tpot_ms", "e2e_ms", "num_chunks", "num_prompt_tokens",
             "num_output_tokens", "token_count_source", "finish_reason", "error", "group",
             "conversation", "turn"]
        )  # fmt: skip
        for run, records in runs:
            for r in records:
                writer.writerow([
                    run.get("concurrency"), run.get("rate"), r.req_id, r.prompt_id, r.tenant,
                    int(r.ok), f"{r.submit_s:.6f}", _ms(r.ttft_s), _ms(r.tpot_s), _ms(r.e2e_s),
                    len(r.chunk_times_s), r.num_prompt_tokens, r.num_output_tokens,
                    r.token_count_source, r.finish_reason or "", r.error,
                    *(r.extra.get(k, "") for k in ("group", "conversation", "turn")),
                ])  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.3f}"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def load_report(path: str | Path) -> dict:
    report = json.loads(Path(path).read_text(encoding="utf-8"))
    if report.get("tool") != "hipfire-loadgen" or "runs" not in report:
        raise ValueError(f"{path}: not a hipfire-loadgen report")
    return report
