"""The record's plot (matplotlib, headless): wave decode tokens/s and step time against C for
both engines with the roofline, and the chat-like workload's output tokens/s."""

from __future__ import annotations

from pathlib import Path

import matplotlib

# The headless backend must be chosen before pyplot is imported.
matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {
    "hipfire": ("C0", "hipfire-serve"),
    "vllm": ("C1", "vLLM"),
    "hipfire-nocache": ("C2", "hipfire-serve, no prefix cache"),
}
PANELS = (
    ("wave", "decode_tok_s", "wave decode tokens/s"),
    ("wave", "step_ms", "wave decode step ms"),
    ("chat", "output_tok_s", "chat-like output tokens/s"),
    ("multiturn", "output_tok_s", "multi-turn output tokens/s"),
    ("multiturn", "ttft.p50_ms", "multi-turn TTFT p50 ms"),
)


def _value(point: dict, key: str):
    for part in key.split("."):
        point = point.get(part) if isinstance(point, dict) else None
    return point


def write_plot(record: dict, path: Path) -> None:
    """One panel per (workload, figure) that some engine measured."""
    measured = {
        w for res in record["engines"].values() for w in ("wave", "chat", "multiturn") if res.get(w)
    }
    panels = [p for p in PANELS if p[0] in measured] or list(PANELS[:1])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4), squeeze=False)
    roof = sorted(record["roofline"], key=lambda r: r["C"])
    for ax, (workload, key, title) in zip(axes[0], panels):
        for name, res in record["engines"].items():
            pts = [p for p in res.get(workload, []) if _value(p, key)]
            pts.sort(key=lambda p: p["C"])
            if pts:
                color, label = STYLE.get(name, (None, name))
                xs = [p["C"] for p in pts]
                ax.plot(xs, [_value(p, key) for p in pts], marker="o", color=color, label=label)
        if workload == "wave":
            top = [r for r in roof if r.get(key)]
            if top:
                xs = [r["C"] for r in top]
                ax.plot(xs, [r[key] for r in top], "k--", linewidth=1, label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency C")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{record['config']['model']} on {record['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
