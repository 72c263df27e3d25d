"""The record's plot (matplotlib, headless): wave decode tokens/s and step time against C for
both engines with the roofline, and the chat-like workload's output tokens/s."""

from __future__ import annotations

from pathlib import Path

import matplotlib

# The headless backend must be chosen before pyplot is imported.
matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"hipfire": ("C0", "hipfire-serve"), "vllm": ("C1", "vLLM")}
PANELS = (
    ("wave", "decode_tok_s", "wave decode tokens/s"),
    ("wave", "step_ms", "wave decode step ms"),
    ("chat", "output_tok_s", "chat-like output tokens/s"),
)


def write_plot(record: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.4), squeeze=False)
    roof = sorted(record["roofline"], key=lambda r: r["C"])
    for ax, (workload, key, title) in zip(axes[0], PANELS):
        for name, res in record["engines"].items():
            pts = sorted((p for p in res.get(workload, []) if p.get(key)), key=lambda p: p["C"])
            if pts:
                color, label = STYLE.get(name, (None, name))
                xs = [p["C"] for p in pts]
                ax.plot(xs, [p[key] for p in pts], marker="o", color=color, label=label)
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
