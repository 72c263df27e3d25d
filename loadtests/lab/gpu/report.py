"""Aggregation, targets and the report of `hipfire-bench gpu` (`loadtests/lab/gpu/main.py`):
figures over repeats, adaptive against the fixed policies, the simulator's error, the issue's
targets, and the outputs (terminal table, `gpu.md`, `gpu.json`, PNG plots)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadtests.lab.gpu.block import block_lines
from loadtests.lab.gpu.mix import ANY, AR, decode_mix, mean_mix, spec_share
from loadtests.lab.gpu.plots import write_plots
from loadtests.table import fmt, render

FLOOR = 0.98  # adaptive's target against the better fixed policy at every point


# -- aggregation and targets -----------------------------------------------------------------
def spread(values: Sequence[float | None]) -> dict | None:
    """Mean, min, max and count over repeats; None when no repeat had the figure."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _ratio_error(pred, real) -> float | None:
    return pred / real - 1.0 if pred is not None and real else None


def summarize(runs: list[dict], sims: dict[tuple, dict]) -> list[dict]:
    """One row per (policy, drafter, cohort, C): real figures over repeats and the simulator's."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["policy"], r["drafter"], r["cohort"], r["concurrency"]), []).append(r)
    rows = []
    for key in sorted(set(groups) | set(sims), key=lambda k: (k[1], k[2], k[3], k[0])):
        rs = groups.get(key, [])
        sim = sims.get(key)
        full = spread([r["full_live_tok_s"] for r in rs])
        refill = spread([r["refill_tok_s"] for r in rs])
        phase_names = sorted({n for r in rs for n in r["phase_ms_full_live"]})
        rows.append(
            {
                "policy": key[0],
                "drafter": key[1],
                "cohort": key[2],
                "concurrency": key[3],
                "num_repeats": len(rs),
                "full_live_tok_s": full,
                "refill_tok_s": refill,
                "route_mix_full_live": mean_mix([r["route_mix_full_live"] for r in rs]),
                "route_mix": mean_mix([r["route_mix"] for r in rs]),
                "mean_rows_full_live": _mean(r["mean_rows_full_live"] for r in rs),
                "drafts_per_spec_full_live": _mean(r.get("drafts_per_spec_full_live") for r in rs),
                "accepted_share_full_live": _mean(r.get("accepted_share_full_live") for r in rs),
                "mean_accepted_len": _mean(r["mean_accepted_len"] for r in rs),
                "pred_error": _mean(r["pred_error"] for r in rs),
                "host_share_full_live": _mean(r["host_share_full_live"] for r in rs),
                "step_ms_full_live": _mean(r["step_ms_full_live"] for r in rs),
                "phase_ms_full_live": {
                    n: float(np.mean([r["phase_ms_full_live"].get(n, 0.0) for r in rs]))
                    for n in phase_names
                },
                "sim": sim,
                "sim_error_full_live": _ratio_error(
                    sim and sim["full_live_tok_s"], full and full["mean"]
                ),
                "sim_error_refill": _ratio_error(
                    sim and sim["refill_tok_s"], refill and refill["mean"]
                ),
            }
        )
    return rows


def _figure(row: dict | None, metric: str) -> float | None:
    if row is None or row[metric] is None:
        return None
    return row[metric]["mean"]


def compare_policies(
    rows: list[dict], points: Sequence[tuple[str, str]], concurrency: Sequence[int]
) -> list[dict]:
    """Adaptive against all-AR and all-spec per (drafter, cohort, C) on full-live tokens/s when
    all three have full-live rounds, else on finite refill tokens/s; the crossover C of each
    (drafter, cohort) is where all-AR overtakes all-spec (of the two C around the sign change,
    the one with the smaller |log(spec/AR)|)."""
    index = {(r["policy"], r["drafter"], r["cohort"], r["concurrency"]): r for r in rows}
    out = []
    for drafter, cohort in points:
        found = []
        for c in concurrency:
            trio = [
                index.get(("adaptive", drafter, cohort, c)),
                index.get((AR, ANY, ANY, c)),
                index.get(("all-spec", drafter, cohort, c)),
            ]
            metric = "full_live_tok_s"
            if any(_figure(r, metric) is None for r in trio):
                metric = "refill_tok_s"
            ada, ar, spec = (_figure(r, metric) for r in trio)
            if ada is None or ar is None or spec is None:
                continue
            found.append(
                {
                    "drafter": drafter,
                    "cohort": cohort,
                    "concurrency": c,
                    "metric": metric,
                    "adaptive": ada,
                    "all-ar": ar,
                    "all-spec": spec,
                    "vs_best": ada / max(ar, spec),
                    "vs_ar": ada / ar,
                    "vs_spec": ada / spec,
                    "crossover": False,
                }
            )
        cross = crossover_index([p["all-spec"] / p["all-ar"] for p in found])
        if cross is not None:
            found[cross]["crossover"] = True
        out += found
    return out


def crossover_index(spec_over_ar: Sequence[float]) -> int | None:
    """Index where spec/AR first drops to <= 1 (or its neighbour before, if nearer to 1)."""
    for i, ratio in enumerate(spec_over_ar):
        if ratio <= 1.0:
            if i > 0 and abs(math.log(spec_over_ar[i - 1])) < abs(math.log(ratio)):
                return i - 1
            return i
    return None


def check_targets(comparisons, rows, roofline, idle) -> dict:
    """The issue's targets, each with its worst case and the points that miss it."""

    def verdict(misses, worst, bound, measured: bool = True) -> dict:
        status = "not measured" if not measured else ("met" if not misses else "missed")
        return {"status": status, "worst": worst, "bound": bound, "misses": misses}

    vs_best = [p for p in comparisons if p["vs_best"] < FLOOR]
    cross = [p for p in comparisons if p["crossover"]]
    cross_miss = [p for p in cross if min(p["vs_ar"], p["vs_spec"]) < 1.05]
    roof = [r for r in roofline if r["ratio"] is not None]
    roof_miss = [r for r in roof if r["ratio"] > 1.3]
    idle_frac = {k: v["gpu_idle_fraction"] for k, v in idle.items()}
    sims = []
    for r in rows:
        err = r["sim_error_full_live"]
        metric = "full_live_tok_s"
        if err is None:
            err, metric = r["sim_error_refill"], "refill_tok_s"
        if err is not None:
            sims.append(
                {
                    **{k: r[k] for k in ("policy", "drafter", "cohort", "concurrency")},
                    "metric": metric,
                    "error": err,
                }
            )
    sim_miss = [s for s in sims if abs(s["error"]) > 0.10]
    return {
        "adaptive_vs_best": verdict(
            vs_best,
            min((p["vs_best"] for p in comparisons), default=None),
            FLOOR,
            bool(comparisons),
        ),
        "adaptive_at_crossover": verdict(
            cross_miss,
            min((min(p["vs_ar"], p["vs_spec"]) for p in cross), default=None),
            1.05,
            bool(cross),
        ),
        "roofline": verdict(
            roof_miss, max((r["ratio"] for r in roof), default=None), 1.3, bool(roof)
        ),
        "gpu_idle_c64": verdict(
            [k for k, v in idle_frac.items() if v >= 0.10],
            max(idle_frac.values(), default=None),
            0.10,
            bool(idle_frac),
        ),
        "simulator": verdict(
            sim_miss, max((abs(s["error"]) for s in sims), default=None), 0.10, bool(sims)
        ),
        "simulator_errors": sims,
    }


# -- outputs ---------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _spread_text(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:,.0f}"
    return f"{s['mean']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def comparison_table(comparisons: list[dict], markdown: bool = False) -> str:
    headers = [
        "drafter",
        "cohort",
        "C",
        "metric",
        "all-AR",
        "all-spec",
        "adaptive",
        "/best",
        "/AR",
        "/spec",
        "crossover",
    ]
    rows = [
        [
            p["drafter"],
            p["cohort"],
            str(p["concurrency"]),
            "full-live" if p["metric"] == "full_live_tok_s" else "refill",
            fmt(p["all-ar"], 0),
            fmt(p["all-spec"], 0),
            fmt(p["adaptive"], 0),
            f"{p['vs_best']:.3f}",
            f"{p['vs_ar']:.3f}",
            f"{p['vs_spec']:.3f}",
            "yes" if p["crossover"] else "",
        ]
        for p in comparisons
    ]
    return _md_table(headers, rows) if markdown else render(headers, rows)


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _point_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        sim = r["sim"] or {}
        mix = decode_mix(r)
        out.append(
            [
                r["drafter"],
                r["cohort"],
                r["policy"],
                str(r["concurrency"]),
                str(r["num_repeats"]),
                _spread_text(r["full_live_tok_s"]),
                _spread_text(r["refill_tok_s"]),
                fmt(sim.get("full_live_tok_s"), 0),
                fmt(sim.get("refill_tok_s"), 0),
                _pct(r["sim_error_full_live"]),
                _pct(r["sim_error_refill"]),
                fmt(spec_share(mix), 2),
                fmt(r["mean_accepted_len"], 2),
                fmt(sim.get("mean_accepted_len"), 2),
                fmt(r["mean_rows_full_live"], 1),
                _pct(r["pred_error"]).lstrip("+"),
                _pct(r["host_share_full_live"]).lstrip("+"),
            ]
        )
    return out


POINT_HEADERS = [
    "drafter",
    "cohort",
    "policy",
    "C",
    "reps",
    "full-live tok/s",
    "refill tok/s",
    "sim full-live",
    "sim refill",
    "sim err full",
    "sim err refill",
    "S share",
    "acc len",
    "sim acc len",
    "rows",
    "round pred err",
    "host share",
]


def _target_lines(targets: dict) -> list[str]:
    names = {
        "adaptive_vs_best": "adaptive >= 0.98 x max(all-AR, all-spec) at every C and cohort",
        "adaptive_at_crossover": "adaptive >= 1.05 x both at each cohort's crossover C",
        "roofline": "round time <= 1.3 x roofline at every measured shape",
        "gpu_idle_c64": "GPU idle between rounds < 10% at C = 64",
        "simulator": "simulator within 10% of measured tokens/s at every point",
    }
    lines = ["| target | status | worst | bound | points missing |", "|---|---|---:|---:|---:|"]
    for key, text in names.items():
        t = targets[key]
        worst = "-" if t["worst"] is None else f"{t['worst']:.3f}"
        lines.append(f"| {text} | {t['status']} | {worst} | {t['bound']} | {len(t['misses'])} |")
    return lines


def _miss_lines(targets: dict, rows: list[dict]) -> list[str]:
    """Each missed comparison with the round-phase profile of the runs involved (ms per
    full-live step: the executor's phases, the scheduler's plan/update, and the rest)."""
    index = {(r["policy"], r["drafter"], r["cohort"], r["concurrency"]): r for r in rows}
    misses = targets["adaptive_vs_best"]["misses"] + [
        p
        for p in targets["adaptive_at_crossover"]["misses"]
        if p not in targets["adaptive_vs_best"]["misses"]
    ]
    if not misses:
        return []
    lines = [
        "",
        "### Where adaptive misses: round phases (ms per full-live step)",
        "",
        "Drafts / S: drafts per speculating request-round of the full-live steps (the depths "
        "the policy chose); accepted: the share of those drafts accepted.",
        "",
    ]
    phase_names = ["build", "draft", "forward", "accept", "commit", "plan", "collect", "update"]
    headers = [
        "drafter",
        "cohort",
        "C",
        "policy",
        "vs best",
        "step",
        *phase_names,
        "other",
        "rows",
        "S share",
        "drafts / S",
        "accepted",
    ]
    table = []
    for p in misses:
        for policy in ("adaptive", AR, "all-spec"):
            key = (
                (policy, ANY, ANY, p["concurrency"])
                if policy == AR
                else (policy, p["drafter"], p["cohort"], p["concurrency"])
            )
            r = index.get(key)
            if r is None or r["step_ms_full_live"] is None:
                continue
            ph = r["phase_ms_full_live"]
            other = r["step_ms_full_live"] - sum(ph.get(n, 0.0) for n in phase_names)
            table.append(
                [
                    p["drafter"],
                    p["cohort"],
                    str(p["concurrency"]),
                    policy,
                    f"{p['vs_best']:.3f}" if policy == "adaptive" else "",
                    f"{r['step_ms_full_live']:.2f}",
                    *(f"{ph.get(n, 0.0):.2f}" for n in phase_names),
                    f"{other:.2f}",
                    fmt(r["mean_rows_full_live"], 1),
                    f"{r['route_mix_full_live'].get('S', 0.0):.2f}",
                    fmt(r.get("drafts_per_spec_full_live"), 2),
                    fmt(r.get("accepted_share_full_live"), 2),
                ]
            )
    return [*lines, _md_table(headers, table)]


STALL_FACTOR = 10.0
STALL_MS = 100.0


def stall_rows(runs: list[dict]) -> list[list[str]]:
    """Per run with a stalled round (measured over STALL_FACTOR x predicted and STALL_MS):
    the stalls and what the run compiled or captured meanwhile."""
    rows = []
    for run in runs:
        stalls = [
            m
            for p, m, _ in run.get("pred_vs_meas") or []
            if m > STALL_MS and p > 0 and m > STALL_FACTOR * p
        ]
        if not stalls:
            continue
        c = run.get("compiles") or {}
        compiled = (
            f"{c['count']} ({c['seconds']} s): {', '.join(c['kernels'])}" if c.get("count") else "0"
        )
        rows.append(
            [
                run["policy"],
                run["drafter"],
                run["cohort"],
                str(run["concurrency"]),
                ", ".join(f"{m:.0f}" for m in stalls),
                compiled if c else "not recorded",
                str(run.get("draft_graphs_captured", "-")),
            ]
        )
    return rows


def pooled_lines(record: dict) -> list[str]:
    """A pooled record's points as each pooled record measured them: adaptive over the better
    fixed policy, pooled and per record (empty for a record of one call)."""
    parts = record.get("pooled_records") or []
    if len(parts) < 2:
        return []
    each = [{tuple(v[:3]): v[3] for v in part["vs_best"]} for part in parts]
    rows = []
    for c in record["comparisons"]:
        key = (c["drafter"], c["cohort"], c["concurrency"])
        ratios = [e.get(key) for e in each]
        low = sum(1 for r in ratios if r is not None and r < FLOOR)
        rows.append(
            [
                *(str(k) for k in key),
                f"{c['vs_best']:.3f}",
                *("-" if r is None else f"{r:.3f}" for r in ratios),
                f"{low} of {sum(r is not None for r in ratios)}",
            ]
        )
    return [
        "",
        "### Adaptive / better fixed policy in each pooled record",
        "",
        _md_table(
            [
                "drafter",
                "cohort",
                "C",
                "pooled",
                *(f"record {i + 1}" for i in range(len(parts))),
                f"records below {FLOOR}",
            ],
            rows,
        ),
        "",
        "Records: " + "; ".join(f"{i + 1}: {p['label']}" for i, p in enumerate(parts)) + ".",
    ]


def _estimator_line(cfg: dict) -> str:
    """How the runs' schedulers started their acceptance estimates (records made before the
    option existed started every run cold)."""
    if cfg.get("cold_estimator", True):
        return (
            "Every run's scheduler started at the configured acceptance prior (cold): each "
            "point includes the probing a fresh server does before it knows its drafter."
        )
    return (
        "Each run's scheduler adopted what the previous run of its repeat, policy, drafter and "
        "cohort had learned of the drafter (acceptance prior, evidence, per-position "
        "calibration), as a server whose load rises on that traffic keeps it; the lowest C of "
        "each starts at the configured prior. The simulator's runs do the same."
    )


def markdown(record: dict) -> str:
    cfg = record["config"]
    ceil = record["profile"].get("ceilings") or {}
    lines = [
        "# End-to-end engine benchmark: adaptive vs all-AR vs all-spec",
        "",
        f"Measured on {record['device']}, {record['date']}, torch {record['torch']}, by "
        f"`hipfire-bench gpu` in {record['elapsed_s']:.0f} s (JSON: `gpu.json`).",
        "",
        f"Target `{cfg['model']}` (random weights, {cfg['dtype']}); cost drafters "
        f"{', '.join(f'`{d}`' for d in cfg['drafters'])} run every speculative round for their "
        "cost while acceptance comes from the shared acceptance models (`synthetic` drafter). "
        f"Refill workload: C slots, max({cfg['waves']} x C, {cfg['min_requests']}) requests, "
        f"prompts uniform in [{cfg['prompt_len'] // 2}, {cfg['prompt_len'] * 3 // 2}] tokens, "
        f"{cfg['max_tokens']} output tokens (ignore_eos, greedy), spec depth "
        f"{cfg['spec_depth']}, prefill budget {cfg['max_prefill_tokens']} tokens per round; "
        f"{cfg['repeats']} repeats planned (figures: mean (min-max)).",
        "",
        _estimator_line(cfg),
        "",
        "Full-live tokens/s: tokens of the steps whose round ran all C requests decoding, over "
        "those steps' wall time (plan + executor + update). Finite refill tokens/s: all tokens "
        "over the whole run. Where a policy has no full-live round at some C (requests finish "
        "while successors still prefill), comparisons use refill tokens/s.",
        "",
    ]
    if ceil:
        lines += [
            f"Ceilings measured in this run: copy {ceil['copy_read_plus_write_TBps']} TB/s "
            f"(read + write), bf16 GEMM {ceil['bf16_gemm_TFLOPs']} TFLOP/s.",
            "",
        ]
    if record.get("notes"):
        lines += [*(f"Note: {n}" for n in record["notes"]), ""]
    lines += ["## Targets", "", *_target_lines(record["targets"]), ""]
    lines += [
        "## Adaptive against the fixed policies",
        "",
        comparison_table(record["comparisons"], markdown=True),
    ]
    lines += pooled_lines(record)
    lines += _miss_lines(record["targets"], record["summary"])
    lines += block_lines(record)
    lines += [
        "",
        "## Every point, measured and simulated",
        "",
        "Sim: the simulator with the profile measured in this run, replaying each run's "
        "workload and acceptance traces (the synthetic drafter's, keyed by the run's prompts), "
        f"the mean of {cfg['sim_seeds']} seeds of its timing noise; error = sim / measured - 1. "
        "Round pred err: mean "
        "|predicted - measured| / measured round time of the scheduler's cost model. Host "
        "share: part of a full-live step outside the target forward and the drafter (an "
        "upper bound of GPU idle). S share: speculating share of decoding request-rounds "
        "(full-live rounds where the run had some). Acc len: tokens per speculating "
        "request-round; the simulator draws its own acceptance from the same models, so a "
        "gap between the two acceptance lengths is luck of the draw, not cost-model error.",
        "",
        _md_table(POINT_HEADERS, _point_rows(record["summary"])),
    ]
    roof = [r for r in record["roofline"] if r["ratio"] is not None]
    if roof:
        lines += [
            "",
            "## Round time against the roofline",
            "",
            "Whole `RoundExecutor.run` rounds of the profile grid (AR rows up to the slot "
            "count, speculative groups past it). Roofline = max(bytes / copy BW, FLOPs / "
            "GEMM rate), bytes = weights + KV read. Shapes over 1.3 x were timed again phase "
            "by phase (median ms): the target forward (device time) against the host's build, "
            "acceptance and commit.",
            "",
        ]
        phases = ("forward", "build", "accept", "commit")
        lines.append(
            _md_table(
                ["rows", "seqs", "KV per seq", "round ms", "roofline ms", "ratio", *phases],
                [
                    [
                        str(r["rows"]),
                        str(r["seqs"]),
                        str(r["kv_len"]),
                        f"{r['round_ms']:.3f}",
                        f"{r['roofline_ms']:.3f}",
                        f"{r['ratio']:.2f}",
                        *(fmt(r.get("phases_ms", {}).get(n), 3) for n in phases),
                    ]
                    for r in roof
                ],
            )
        )
    if record["idle"]:
        lines += [
            "",
            f"## GPU idle in the engine loop, C = {cfg['idle_concurrency']}",
            "",
            "Torch profiler over decode rounds: idle = 1 - union of kernel time / wall.",
            "",
        ]
        lines.append(
            _md_table(
                ["policy", "wall ms/round", "GPU busy ms/round", "idle"],
                [
                    [
                        k,
                        f"{v['wall_ms_per_round']:.3f}",
                        f"{v['gpu_busy_ms_per_round']:.3f}",
                        f"{100 * v['gpu_idle_fraction']:.1f}%",
                    ]
                    for k, v in record["idle"].items()
                ],
            )
        )
    stalls = stall_rows(record["runs"])
    if stalls:
        lines += [
            "",
            "## Stalls",
            "",
            f"Runs with a round over {STALL_FACTOR:.0f} x its prediction and over "
            f"{STALL_MS:.0f} ms (of the sampled rounds), with the Triton compilations and draft "
            "graph captures made during the run.",
            "",
            _md_table(
                ["policy", "drafter", "cohort", "C", "stall ms", "compilations", "draft graphs"],
                stalls,
            ),
        ]
    if record["skipped"]:
        lines += ["", f"## Runs not made (time budget {cfg['time_budget_s']:.0f} s)", ""]
        lines += [
            f"- repeat {s['repeat']}: {s['policy']} {s['drafter']} {s['cohort']} "
            f"C={s['concurrency']}: {s['reason']}"
            for s in record["skipped"]
        ]
    lines += [
        "",
        "Plots: `gpu-throughput.png`, `gpu-route-mix.png`, `gpu-predicted.png`, "
        "`gpu-roofline.png`.",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(record: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "gpu.json", out / "gpu.md"]
    paths[0].write_text(json.dumps(record, indent=1))
    paths[1].write_text(markdown(record))
    paths += write_plots(record, out)
    return paths
