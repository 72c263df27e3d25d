"""The `hipfire-bench quant` record written out: `quant.md` (formats, decode against each
format's roofline, ratios to bf16 beside the targets), `quant.json` and `quant.png`."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.lab.quant_record import BASELINE, FP8_GEMM_SPEEDUP, METHOD

LABELS = {"bf16": "bf16", "fp8": "FP8", "w4a16": "W4A16"}
COLORS = {"bf16": "C0", "fp8": "C1", "w4a16": "C2"}


def _f(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def _by_c(points: list[dict]) -> dict[int, dict]:
    return {p["C"]: p for p in points}


def _share(point: dict, roof: dict) -> str:
    tok, top = point.get("decode_tok_s"), roof.get("decode_tok_s")
    return f"{100 * tok / top:.0f}%" if tok and top else "-"


def _formats_table(record: dict) -> list[str]:
    lines = [
        "## Formats",
        "",
        "| format | layout | linear layers | weight bytes read per step (C=1) | start-up s "
        "| greedy agreement with bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in record["formats"].items():
        fmt = res.get("format") or {}
        wb = fmt.get("weight_bytes")
        layout = fmt.get("layout")
        layout_text = "dense" if not layout else json.dumps(layout, separators=(",", ":"))
        agree = res.get("agreement")
        agree_text = "-"
        if agree:
            agree_text = (
                f"{100 * agree['position_match']:.0f}% of positions, common prefix "
                f"{agree['mean_common_prefix']:.1f} of {agree['tokens']} tokens, "
                f"{agree['identical_prompts']}/{agree['prompts']} prompts identical"
            )
        bytes_text = _bytes(wb["static"] + wb["per_row"]) if wb else "-"
        lines.append(
            f"| {LABELS.get(name, name)} | `{layout_text}` | {fmt.get('linear_path', '-')} "
            f"| {bytes_text} | {_f(res.get('startup_s'), 1)} | {agree_text} |"
        )
    return [*lines, ""]


def _decode_table(record: dict) -> list[str]:
    names = list(record["formats"])
    waves = {n: _by_c(record["formats"][n].get("wave", [])) for n in names}
    roofs = {n: _by_c(record["formats"][n].get("roofline", [])) for n in names}
    cs = sorted({c for w in waves.values() for c in w})
    if not cs:
        return []
    head = "| C |" + "".join(
        f" {LABELS.get(n, n)} tok/s | step ms | roofline ms | of roofline |" for n in names
    )
    lines = ["## Decode against each format's roofline", "", head]
    lines.append("|---|" + "---|---|---|---|" * len(names))
    for c in cs:
        row = f"| {c} |"
        for n in names:
            p, r = waves[n].get(c, {}), roofs[n].get(c, {})
            row += (
                f" {_f(p.get('decode_tok_s'))} | {_f(p.get('step_ms'), 2)} "
                f"| {_f(r.get('step_ms'), 2)} | {_share(p, r)} |"
            )
        lines.append(row)
    return [*lines, ""]


def _spec_table(record: dict) -> list[str]:
    """Under --spec-mode adaptive: per C and format, the share of decode rounds the policy ran
    speculatively (of the timed N-token waves)."""
    if record["config"].get("spec_mode", "ar") == "ar":
        return []
    names = list(record["formats"])
    waves = {n: _by_c(record["formats"][n].get("wave", [])) for n in names}
    cs = sorted({c for w in waves.values() for c in w})
    lines = [
        "## Decode rounds the adaptive policy ran speculatively",
        "",
        "| C |" + "".join(f" {LABELS.get(n, n)} |" for n in names),
        "|---|" + "---|" * len(names),
    ]
    for c in cs:
        shares = (waves[n].get(c, {}).get("spec_share") for n in names)
        lines.append(f"| {c} |" + "".join(f" {_f(v, 2)} |" for v in shares))
    return [*lines, ""]


def _ratio_table(record: dict) -> list[str]:
    others = [n for n in record["formats"] if n != BASELINE]
    if not record["ratios"] or not others:
        return []
    targets = {(t["C"], t["format"]): t["target"] for t in record["targets"]}
    head = "| C |" + "".join(
        f" {LABELS.get(n, n)} / bf16 | target | roofline ratio |" for n in others
    )
    lines = ["## Decode tokens/s over bf16's", "", head, "|---|" + "---|---|---|" * len(others)]
    for row in record["ratios"]:
        text = f"| {row['C']} |"
        for n in others:
            target = targets.get((row["C"], n))
            mark = ""
            if target and row.get(n) is not None and record["ceilings"]:
                mark = " (met)" if row[n] >= target else " (missed)"
            text += (
                f" **{_f(row.get(n), 2)}**{mark} | {_f(target, 1) if target else '-'} "
                f"| {_f(row.get(n + '_roofline'), 2)} |"
            )
        lines.append(text)
    return [*lines, ""]


def _problems(record: dict) -> list[str]:
    lines = []
    for name, res in record["formats"].items():
        if res.get("error"):
            lines.append(f"- {name}: {res['error']}")
        for e in res.get("errors", []):
            lines.append(f"- {name}: C={e.get('C')}: {e.get('error')}")
        for s in res.get("skipped", []):
            lines.append(f"- {name}: C={s['C']} skipped (expected {s['expected_s']:.0f} s)")
    return ["## Skipped points and errors", "", *lines, ""] if lines else []


def markdown(record: dict, name: str = "quant") -> str:
    cfg, meta, ceil = record["config"], record["meta"], record["ceilings"]
    lo, hi = cfg["wave_prompt_len"]
    mode = cfg.get("spec_mode", "ar")
    decoding = "plain decoding" if mode == "ar" else f"adaptive speculation ({cfg['draft']})"
    kv = cfg["dtype"] if cfg.get("kv_cache_dtype", "auto") == "auto" else "FP8 (e4m3)"
    lines = [
        f"# Quantized weights: {decoding} in {', '.join(LABELS.get(f, f) for f in cfg['formats'])}"
        + ("" if cfg.get("kv_cache_dtype", "auto") == "auto" else ", FP8 KV cache"),
        "",
        f"Measured on {meta.get('device') or 'unknown'}, {meta['date']}, torch "
        f"{meta.get('torch') or '-'}, commit `{meta['commit']}`, by `hipfire-bench quant` "
        f"(JSON: `{name}.json`, plot: `{name}.png`), {meta['elapsed_s']:.0f} s.",
        "",
    ]
    if ceil:
        lines += [
            f"Ceilings measured in the same call: copy {ceil['copy_read_plus_write_TBps']} TB/s "
            f"(read + write), bf16 GEMM {ceil['bf16_gemm_TFLOPs']} TFLOP/s (FP8's linear layers "
            f"bounded at {FP8_GEMM_SPEEDUP:g}x that rate).",
            "",
        ]
    else:
        lines += [
            "No ceilings on this device: no roofline. On a CPU every format runs its torch "
            "reference, so these timings say nothing of the formats' GPU speed (the targets "
            "are not marked).",
            "",
        ]
    lines += [
        f"Model `{cfg['model']}` (random weights, seed 0, the same in every format; "
        f"{record['shape']['num_params'] / 1e6:,.1f} M parameters), activations in "
        f"{cfg['dtype']}, KV in {kv}. Wave: C requests at once, prompts uniform in "
        f"[{lo}, {hi}] tokens, "
        f"1 + {cfg['decode_tokens']} tokens each, best of {cfg['repeats']}; decode tok/s = "
        f"C x {cfg['decode_tokens']} / (tN - t1). W4A16: GPTQ, group {cfg['group_size']}, "
        f"symmetric; FP8: e4m3 with {cfg['fp8_block'][0]} x {cfg['fp8_block'][1]} block "
        "scales (`weight_scale_inv`). The embedding and the LM head stay bf16 in both, as the "
        "releases keep them. Greedy agreement: "
        f"{cfg['agreement_prompts']} prompts x {cfg['agreement_tokens']} tokens.",
        "",
        "Each format's roofline: its own weight bytes read once per step (packed weights, "
        "scales and zeros; the LM head; one embedding line per row) plus the KV of the wave's "
        "mean context, at the copy bandwidth; or its FLOPs, if they take longer.",
        "",
        *_formats_table(record),
        *_decode_table(record),
        *_spec_table(record),
        *_ratio_table(record),
        *_problems(record),
        "## Method",
        "",
        METHOD,
    ]
    return "\n".join(lines)


def write_plot(record: dict, path: Path) -> None:
    """Decode tokens/s per format with its roofline (dashed), and the ratios to bf16."""
    import matplotlib

    matplotlib.use("Agg")  # headless, before pyplot is imported
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for name, res in record["formats"].items():
        color, label = COLORS.get(name), LABELS.get(name, name)
        pts = sorted(
            (p for p in res.get("wave", []) if p.get("decode_tok_s")), key=lambda p: p["C"]
        )
        if pts:
            left.plot([p["C"] for p in pts], [p["decode_tok_s"] for p in pts], "o-",
                      color=color, label=label)  # fmt: skip
        roof = [r for r in res.get("roofline", []) if r.get("decode_tok_s")]
        if roof:
            left.plot([r["C"] for r in roof], [r["decode_tok_s"] for r in roof], "--",
                      color=color, linewidth=1, label=f"{label} roofline")  # fmt: skip
    for name in record["formats"]:
        if name == BASELINE:
            continue
        rows = [r for r in record["ratios"] if r.get(name)]
        color, label = COLORS.get(name), LABELS.get(name, name)
        if rows:
            right.plot([r["C"] for r in rows], [r[name] for r in rows], "o-", color=color,
                       label=f"{label} / bf16")  # fmt: skip
        roof = [r for r in record["ratios"] if r.get(name + "_roofline")]
        if roof:
            right.plot([r["C"] for r in roof], [r[name + "_roofline"] for r in roof], "--",
                       color=color, linewidth=1, label=f"{label} roofline ratio")  # fmt: skip
        for t in record["targets"]:
            if t["format"] == name and t["C"] in record["config"]["concurrency"]:
                right.plot([t["C"]], [t["target"]], "v", color=color, markersize=8)
    right.axhline(1.0, color="k", linewidth=0.8)
    for ax, title in ((left, "decode tokens/s"), (right, "decode tokens/s over bf16 (v: target)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency C")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    left.set_yscale("log")
    fig.suptitle(f"{record['config']['model']} on {record['meta'].get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(record: dict, out: Path, name: str = "quant") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    paths[0].write_text(json.dumps(record, indent=1))
    paths[1].write_text(markdown(record, name))
    write_plot(record, paths[2])
    return paths


def summary_table(record: dict) -> str:
    """The terminal's short table: decode tok/s per format and C, ratios to bf16."""
    names = list(record["formats"])
    waves = {n: _by_c(record["formats"][n].get("wave", [])) for n in names}
    ratios = _by_c(record["ratios"])
    others = [n for n in names if n != BASELINE]
    rows = [
        "C      "
        + "".join(f"{n:>10}" for n in names)
        + "".join(f"{n + '/bf16':>12}" for n in others)
    ]
    for c in sorted({c for w in waves.values() for c in w}):
        line = f"{c:<5}  " + "".join(
            f"{_f(waves[n].get(c, {}).get('decode_tok_s')):>10}" for n in names
        )
        line += "".join(f"{_f(ratios.get(c, {}).get(n), 2):>12}" for n in others)
        rows.append(line)
    return "\n".join(rows)
