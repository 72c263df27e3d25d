"""PNG plots of load reports (matplotlib, headless Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

# The headless backend must be chosen before pyplot is imported.
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _closed(mode: str) -> bool:
    """Closed-loop runs (refill, multi-turn) are keyed by concurrency, open-loop ones by rate."""
    return mode in ("refill", "multi-turn")


def _x(run: dict) -> float:
    return float(run["concurrency"] if _closed(run["mode"]) else run["rate"] or 0.0)


def throughput_plot(reports: Sequence[dict], path: Path) -> None:
    """Tokens/s against concurrency (refill) or offered rate (poisson), one line per label;
    refill reports get a solid full-live line and a dashed finite-refill line."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for report in reports:
        runs = sorted(report["runs"], key=_x)
        xs = [_x(r) for r in runs]
        if report["mode"] == "refill":
            live = [r["full_live_tokens_per_s"] for r in runs]
            line = ax.plot(xs, [v if v is not None else float("nan") for v in live], marker="o",
                           label=f"{report['label']} full-live")[0]  # fmt: skip
            ax.plot(xs, [r["refill_tokens_per_s"] for r in runs], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{report['label']} refill")  # fmt: skip
        else:
            ax.plot(xs, [r["refill_tokens_per_s"] for r in runs], marker="o",
                    label=report["label"])  # fmt: skip
    closed = all(_closed(r["mode"]) for r in reports)
    ax.set_xlabel("concurrency C" if closed else "offered rate (req/s)")
    if closed:
        ax.set_xscale("log", base=2)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_plot(report: dict, path: Path) -> None:
    """TTFT, ITL, TPOT and E2E percentiles (p50/p90/p99) per run."""
    runs = sorted(report["runs"], key=_x)
    xs = [_x(r) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    for ax, lat in zip(axes, ("ttft", "itl", "tpot", "e2e")):
        for q in ("p50_ms", "p90_ms", "p99_ms"):
            ys = [r[lat][q] if r[lat][q] is not None else float("nan") for r in runs]
            ax.plot(xs, ys, marker="o", label=q.split("_")[0])
        ax.set_title(f"{lat.upper()} (ms)")
        ax.set_xlabel("C" if _closed(report["mode"]) else "rate (req/s)")
        if _closed(report["mode"]):
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(report["label"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_plot(report: dict, path: Path) -> None:
    """Output tokens/s over each run's time axis (ramp-up, steady state, drain)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in sorted(report["runs"], key=_x):
        if not run["timeline"]:
            continue
        ts, vs = zip(*run["timeline"])
        key = f"C={run['concurrency']}" if _closed(run["mode"]) else f"rate={run['rate']}"
        ax.plot(ts, vs, label=key, linewidth=1.2)
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{report['label']}: tokens/s over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    label = report["label"]
    paths = [out_dir / f"{label}-{kind}.png" for kind in ("throughput", "latency", "timeline")]
    throughput_plot([report], paths[0])
    latency_plot(report, paths[1])
    timeline_plot(report, paths[2])
    return paths
