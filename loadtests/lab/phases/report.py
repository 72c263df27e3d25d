"""The record of a `phase-profile` call: each engine's points with their per-step phase figures
derived from the kernel tables (`classify.derive`), the roofline, the classification rules;
records of several calls merged and re-classified (`merge_records`); the markdown, JSON and
stacked-bar plot written from it, and the terminal table."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from loadtests.lab.peer.drive import write_json
from loadtests.lab.peer.roofline import wave_roofline
from loadtests.lab.peer.shape import resolve_shape
from loadtests.lab.phases.classify import PHASES, RULES, derive
from loadtests.lab.phases.config import PhaseConfig

# config fields two records must share to be merged (what a step is)
COMPARABLE = ("model", "prompt_len", "warmup_steps", "steps", "seed", "dtype")
NAME_WIDTH = 96  # kernel names in the markdown; the JSON keeps them whole


def roofline(cfg: PhaseConfig, dtype: str, ceilings: dict, concurrency=None) -> list[dict]:
    """`peer-vllm`'s wave roofline at the profiled window's mean context (see
    `PhaseConfig.peer_config`); no step time without measured ceilings."""
    import dataclasses

    peer = cfg.peer_config()
    if concurrency is not None:
        peer = dataclasses.replace(peer, concurrency=tuple(sorted(concurrency)))
    return wave_roofline(peer, resolve_shape(cfg.model), dtype, ceilings)


def build_record(
    cfg: PhaseConfig,
    shape: dict,
    ceilings: dict,
    roof: list[dict],
    engines: dict,
    missing: dict,
    meta: dict,
) -> dict:
    record = {
        "kind": "decode-phases",
        **meta,
        "config": cfg.to_json(),
        "shape": shape,
        "ceilings": ceilings,
        "roofline": roof,
        "engines": engines,
        "missing": missing,
    }
    return rederive(record)


def rederive(record: dict) -> dict:
    """Every point's derived figures from its raw ones, under the current rules."""
    roof = {r["C"]: r.get("step_ms") for r in record["roofline"]}
    for res in record["engines"].values():
        for p in res.get("points", []):
            p.update(derive(p))
            p["roofline_ms"] = roof.get(p["C"])
    record["rules"] = [list(r) for r in RULES]
    versions = {e: r.get("version") for e, r in record["engines"].items() if r.get("version")}
    record["versions"] = versions
    return record


def merge_records(records: list[dict]) -> dict:
    """One record of several calls' (an engine in a later one replaces an earlier one's),
    re-classified; ValueError where they measured different steps."""
    if not records:
        raise ValueError("nothing to merge")
    base = json.loads(json.dumps(records[0]))
    for rec in records[1:]:
        diff = [k for k in COMPARABLE if rec["config"].get(k) != base["config"].get(k)]
        if diff:
            raise ValueError(f"records differ in {', '.join(diff)}")
        base["engines"].update(rec["engines"])
        for engine in rec["engines"]:
            base["missing"].pop(engine, None)
        base["missing"].update(
            {k: v for k, v in rec["missing"].items() if k not in base["engines"]}
        )
        if rec.get("ceilings") and not base.get("ceilings"):
            base["ceilings"], base["device"] = rec["ceilings"], rec.get("device")
        base["commit"] = ", ".join(dict.fromkeys([base["commit"], rec["commit"]]))
    cs = {p["C"] for res in base["engines"].values() for p in res.get("points", [])}
    cfg = PhaseConfig.from_json(base["config"])
    # a checkpoint's shape not here: the first record's roofline stays
    with contextlib.suppress(ValueError, OSError):
        base["roofline"] = roofline(cfg, base["shape"]["dtype"], base["ceilings"], cs or None)
    return rederive(base)


# -- the report --------------------------------------------------------------------------------
def _f(v, nd: int = 3) -> str:
    if v is None:
        return "-"
    return f"{0.0 if abs(v) < 0.5 * 10**-nd else v:.{nd}f}"  # no "-0.000" from rounding


def _name(name: str) -> str:
    short = name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."
    return "`" + short.replace("|", "\\|").replace("`", "'") + "`"


def rows(record: dict) -> list[tuple[int, str, dict]]:
    """(C, engine, point) in C order, engines in record order."""
    out = []
    for engine, res in record["engines"].items():
        out += [(p["C"], engine, p) for p in res.get("points", [])]
    order = {e: i for i, e in enumerate(record["engines"])}
    return sorted(out, key=lambda r: (r[0], order[r[1]]))


HEAD = (*PHASES, "kernels", "busy", "overlap", "wall", "host gap", "roofline", "launches")


def _cells(p: dict) -> list[str]:
    phases = p.get("phases_ms")
    if phases is None:  # a CPU run: no device activity to split
        blank = ["no device"] + ["-"] * (len(PHASES) + 2)
        return [*blank, _f(p.get("wall_ms")), "-", _f(p.get("roofline_ms")), "-"]
    return [
        *(_f(phases[ph]) for ph in PHASES),
        _f(p["kernel_ms"]),
        _f(p["busy_ms"]),
        _f(p["overlap_ms"]),
        _f(p["wall_ms"]),
        _f(p["host_gap_ms"]),
        _f(p.get("roofline_ms")),
        _f(p["num_kernels"], 0),
    ]


def summary_table(record: dict) -> str:
    """The per-step table for the terminal (ms per decode step)."""
    head = ["C", "engine", *HEAD]
    body = [[str(c), e, *_cells(p)] for c, e, p in rows(record)]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


METHOD = """\
Each engine in its own child process (this engine: `LLM(draft="none", spec_mode="ar",
enable_prefix_caching=False)`; vLLM: its offline `LLM` with the engine core in the same process,
VLLM_ENABLE_V1_MULTIPROCESSING=0, dummy weights of the same shape), greedy, EOS ignored. Per C:
a wave of C requests, prefill until each has its first token, {warmup} warm-up decode steps,
then {steps} decode steps timed without the profiler (**wall**) and {steps} under torch.profiler
(CPU + CUDA activity; the kernels of replayed CUDA graphs included), the device synchronised at
both ends of each window. A window's steps are its output tokens / C. Phase columns: the summed
device time of the step's kernels by phase (rules below); **kernels**: their sum; **busy**: the
union of their intervals (kernels overlapping under programmatic dependent launch count once);
**overlap** = kernels - busy; **host gap** = wall - busy (the device idle, waiting for the host);
**roofline**: weights + KV at the measured copy bandwidth or FLOPs at the measured bf16 GEMM rate,
whichever is longer, at the profiled window's mean context (loadtests/lab/peer/roofline.py);
**launches**: device kernels and copies per step. All figures in ms per decode step."""


def markdown(record: dict, name: str) -> str:
    cfg = record["config"]
    ceil = record.get("ceilings") or {}
    versions = ", ".join(f"{e} {v}" for e, v in record.get("versions", {}).items())
    out = [
        f"# Decode step phases: `{cfg['model']}` on {record.get('device') or 'unknown'}",
        "",
        f"Measured {record.get('date')}, commit {record.get('commit')}, torch "
        f"{record.get('torch')}{', ' + versions if versions else ''}, by `hipfire-bench "
        f"phase-profile` (JSON: `{name}.json`, plot: `{name}.png`). Prompts of "
        f"{cfg['prompt_len'][0]}-{cfg['prompt_len'][1]} tokens, dtype {record['shape']['dtype']}; "
        f"ceilings: copy {ceil.get('copy_read_plus_write_TBps', '-')} TB/s (read + write), bf16 "
        f"GEMM {ceil.get('bf16_gemm_TFLOPs', '-')} TFLOP/s.",
        "",
        METHOD.format(warmup=cfg["warmup_steps"], steps=cfg["steps"]),
        "",
        "| C | engine | " + " | ".join(HEAD) + " |",
        "|---:|---|" + "---:|" * len(HEAD),
    ]
    out += [f"| {c} | {e} | " + " | ".join(_cells(p)) + " |" for c, e, p in rows(record)]
    notes = [f"- {engine}: not run ({why})" for engine, why in record.get("missing", {}).items()]
    for engine, res in record["engines"].items():
        if res.get("error"):
            notes.append(f"- {engine}: {res['error']}")
        notes += [f"- {engine}: C = {e.get('C')}: {e['error']}" for e in res.get("errors", [])]
        notes += [
            f"- {engine}: C = {sk['C']} skipped (expected {sk['expected_s']:.0f} s)"
            for sk in res.get("skipped", [])
        ]
    if notes:
        out += ["", *notes]
    out += ["", "## Top kernels", ""]
    for c, e, p in rows(record):
        if not p.get("top"):
            continue
        out += [f"{e}, C = {c}:", "", "| kernel | phase | ms/step | launches/step | share |"]
        out.append("|---|---|---:|---:|---:|")
        out += [
            f"| {_name(k['name'])} | {k['phase']} | {k['ms']:.3f} | {k['count']:.1f} | "
            f"{100 * k['share']:.1f}% |"
            for k in p["top"]
        ]
        out.append("")
    if not any(p.get("top") for _, _, p in rows(record)):
        out += ["- none (no device activity recorded)", ""]
    out += ["## Kernels no rule matched (counted as other)", ""]
    others = [(c, e, p) for c, e, p in rows(record) if p.get("other")]
    for c, e, p in others:
        listed = "; ".join(f"{_name(k['name'])} {k['ms']:.3f} ms" for k in p["other"][:20])
        more = f" (+{len(p['other']) - 20} more in the JSON)" if len(p["other"]) > 20 else ""
        out.append(f"- {e}, C = {c}: {listed}{more}")
    if not others:
        out.append("- none")
    out += ["", "## Classification rules (first match wins)", "", "| phase | regex |", "|---|---|"]
    out += [f"| {ph} | `{rx.replace('|', chr(92) + '|')}` |" for ph, rx in record["rules"]]
    return "\n".join(out) + "\n"


def write_plot(record: dict, path: Path) -> None:
    """Stacked bars per (C, engine): the phases' ms per step, the host gap hatched on top, the
    roofline as a black tick."""
    import matplotlib

    matplotlib.use("Agg")  # headless, chosen before pyplot is imported
    import matplotlib.pyplot as plt

    data = rows(record)
    engines = list(record["engines"])
    cs = sorted({c for c, _, _ in data})
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cs) * len(engines)), 4.8))
    colors = {ph: f"C{i}" for i, ph in enumerate(PHASES)}
    labelled: set[str] = set()
    ticks: list[tuple[float, str]] = []
    for c, engine, p in data:
        x = cs.index(c) + (engines.index(engine) - (len(engines) - 1) / 2) * width
        bottom = 0.0
        phases = p.get("phases_ms") or {}
        for ph in PHASES:
            v = phases.get(ph) or 0.0
            label = ph if ph not in labelled and v else None
            ax.bar(x, v, width * 0.9, bottom=bottom, color=colors[ph], label=label)
            if label:
                labelled.add(ph)
            bottom += v
        gap = p.get("host_gap_ms") if phases else p.get("wall_ms")
        if gap and gap > 0:
            label = "host gap" if "gap" not in labelled else None
            kw = dict(bottom=bottom, color="white", edgecolor="grey", hatch="//")
            ax.bar(x, gap, width * 0.9, label=label, **kw)
            labelled.add("gap")
        if p.get("roofline_ms"):
            label = "roofline" if "roof" not in labelled else None
            ax.hlines(p["roofline_ms"], x - width / 2, x + width / 2, colors="k", label=label)
            labelled.add("roof")
        ticks.append((x, f"{engine}\nC = {c}"))
    ax.set_xticks([x for x, _ in ticks], [t for _, t in ticks], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{record['config']['model']} on {record.get('device')}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    if labelled:
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(record: dict, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    write_json(paths[0], record)
    paths[1].write_text(markdown(record, name))
    write_plot(record, paths[2])
    return paths
