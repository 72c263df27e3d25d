"""PNG plots of `hipfire-bench gpu` (matplotlib, headless Agg backend): tokens/s against C per
policy and cohort, the adaptive route mix, predicted against measured round time, and round
time against the roofline."""

from __future__ import annotations

from pathlib import Path

import matplotlib

# The headless backend must be chosen before pyplot is imported.
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtests.lab.gpu.mix import ANY, AR, decode_mix, spec_share


def _rows_for(record: dict, policy: str, drafter: str, cohort: str) -> list[dict]:
    if policy == AR:
        drafter = cohort = ANY
    rows = [
        r
        for r in record["summary"]
        if (r["policy"], r["drafter"], r["cohort"]) == (policy, drafter, cohort)
    ]
    return sorted(rows, key=lambda r: r["concurrency"])


def _colors(record: dict) -> dict[str, str]:
    """One colour per policy, the same in every plot."""
    cfg = record["config"]
    names = dict.fromkeys([*cfg["sim_policies"], *cfg["policies"]])
    return {p: f"C{i % 10}" for i, p in enumerate(names)}


def _panels(record: dict) -> list[tuple[str, str]]:
    return [tuple(p) for p in record["config"]["points"]]


def throughput_plot(record: dict, path: Path) -> None:
    """Full-live (top) and finite refill (bottom) tokens/s against C, one panel per (drafter,
    cohort): measured means with min-max bars (solid), the simulator's prediction (dashed)."""
    panels = _panels(record)
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.5), squeeze=False)
    policies = list(record["config"]["policies"])
    colors = _colors(record)
    for col, (drafter, cohort) in enumerate(panels):
        for row, metric in enumerate(("full_live_tok_s", "refill_tok_s")):
            ax = axes[row][col]
            for policy in policies:
                rows = [r for r in _rows_for(record, policy, drafter, cohort) if r[metric]]
                if rows:
                    xs = [r["concurrency"] for r in rows]
                    mean = [r[metric]["mean"] for r in rows]
                    err = [
                        [m - r[metric]["min"] for m, r in zip(mean, rows)],
                        [r[metric]["max"] - m for m, r in zip(mean, rows)],
                    ]
                    ax.errorbar(
                        xs,
                        mean,
                        yerr=err,
                        marker="o",
                        color=colors.get(policy),
                        label=policy,
                        capsize=2,
                    )
                sims = [
                    r
                    for r in _rows_for(record, policy, drafter, cohort)
                    if r["sim"] and r["sim"][metric]
                ]
                if sims:
                    ax.plot(
                        [r["concurrency"] for r in sims],
                        [r["sim"][metric] for r in sims],
                        linestyle="--",
                        color=colors.get(policy),
                        alpha=0.7,
                        label=f"{policy} (sim)",
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("concurrency C")
            ax.set_ylabel("full-live tokens/s" if row == 0 else "finite refill tokens/s")
            ax.set_title(f"{drafter} / {cohort}", fontsize=9)
            ax.grid(True, alpha=0.3, which="both")
    _legend(axes[0][0], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def route_mix_plot(record: dict, path: Path) -> None:
    """Share of decoding request-rounds that speculated, per speculative policy and C (full-live
    rounds; all rounds where a run had none); crosses: the simulator's adaptive share."""
    panels = _panels(record)
    policies = [p for p in record["config"]["policies"] if p != AR]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    width = 0.8 / max(len(policies), 1)
    colors = _colors(record)
    for col, (drafter, cohort) in enumerate(panels):
        ax = axes[0][col]
        concurrency = record["config"]["concurrency"]
        for i, policy in enumerate(policies):
            by_c = {r["concurrency"]: r for r in _rows_for(record, policy, drafter, cohort)}
            shares = []
            for c in concurrency:
                r = by_c.get(c)
                mix = decode_mix(r) if r and r["num_repeats"] else {}
                share = spec_share(mix)
                shares.append(float("nan") if share is None else share)
            xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(concurrency))]
            ax.bar(xs, shares, width=width, label=policy, color=colors.get(policy))
        sim = {r["concurrency"]: r["sim"] for r in _rows_for(record, "adaptive", drafter, cohort)}
        ys = [
            sim[c]["route_mix_full_live"].get("S", float("nan"))
            if sim.get(c) and sum(sim[c]["route_mix_full_live"].values())
            else float("nan")
            for c in concurrency
        ]
        ax.plot(range(len(concurrency)), ys, "kx", label="adaptive (sim)")
        ax.set_xticks(range(len(concurrency)), [str(c) for c in concurrency])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("concurrency C")
        ax.set_ylabel("speculating share")
        ax.set_title(f"{drafter} / {cohort}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    _legend(axes[0][0], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def predicted_plot(record: dict, path: Path) -> None:
    """The scheduler's predicted round time against the executor's measured one (sampled
    rounds of every run), with the +-10% band."""
    fig, ax = plt.subplots(figsize=(6, 5.5))
    by_policy: dict[str, list] = {}
    for run in record["runs"]:
        by_policy.setdefault(run["policy"], []).extend(run["pred_vs_meas"])
    lo, hi = float("inf"), 0.0
    for policy, pts in sorted(by_policy.items()):
        pts = [p for p in pts if p[0] > 0 and p[1] > 0]
        if not pts:
            continue
        ax.scatter(
            [p[1] for p in pts],
            [p[0] for p in pts],
            s=5,
            alpha=0.5,
            label=policy,
            color=_colors(record).get(policy),
        )
        lo = min(lo, *(min(p[0], p[1]) for p in pts))
        hi = max(hi, *(max(p[0], p[1]) for p in pts))
    if hi > 0:
        line = [lo, hi]
        ax.plot(line, line, "k-", linewidth=0.8)
        ax.plot(line, [v * 1.1 for v in line], "k:", linewidth=0.8)
        ax.plot(line, [v / 1.1 for v in line], "k:", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured round time (ms)")
    ax.set_ylabel("predicted round time (ms)")
    ax.set_title("Cost model: predicted vs measured (dotted: +-10%)")
    ax.grid(True, alpha=0.3, which="both")
    _legend(ax, fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def roofline_plot(record: dict, path: Path) -> None:
    """Round time over rows at each KV length (solid), its roofline (dashed)."""
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, kv_len in enumerate(sorted({r["kv_len"] for r in record["roofline"]})):
        pts = sorted(
            (r for r in record["roofline"] if r["kv_len"] == kv_len), key=lambda r: r["rows"]
        )
        xs = [r["rows"] for r in pts]
        ax.plot(
            xs,
            [r["round_ms"] for r in pts],
            marker="o",
            color=f"C{i}",
            label=f"round, KV {kv_len}/seq",
        )
        if all(r["roofline_ms"] for r in pts):
            ax.plot(
                xs,
                [r["roofline_ms"] for r in pts],
                linestyle="--",
                color=f"C{i}",
                label=f"roofline, KV {kv_len}/seq",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per round")
    ax.set_ylabel("ms")
    ax.set_title("Executor round time against the roofline")
    ax.grid(True, alpha=0.3, which="both")
    _legend(ax, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:  # an empty run (all skipped) has nothing to name
        ax.legend(**kwargs)


def write_plots(record: dict, out: Path) -> list[Path]:
    plots = {
        "gpu-throughput.png": throughput_plot,
        "gpu-route-mix.png": route_mix_plot,
        "gpu-predicted.png": predicted_plot,
        "gpu-roofline.png": roofline_plot,
    }
    for name, draw in plots.items():
        draw(record, out / name)
    return [out / name for name in plots]
