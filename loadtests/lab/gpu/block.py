"""The block drafter's figures of `hipfire-bench gpu` (when a cost drafter is one): what its
drafting costs of a speculating round, from the profile's block measurements against the runs'
rounds, and its targets (`docs/perf/block-drafting.md`)."""

from __future__ import annotations

import numpy as np

SPEEDUP_C1_CODE = 3.0  # all-spec over all-AR at C = 1 on code
SHARE_BOUND = 0.10  # drafting's share of a speculating round at C <= SHARE_MAX_C
SHARE_MAX_C = 16
FLOOR, CROSS = 0.98, 1.05  # adaptive against the better fixed policy; both at the crossover


def drafting_ms(block: dict, num_spec: int, context_len: float, drafts: int, rows: int) -> dict:
    """What drafting costs one speculating round of `num_spec` requests of `context_len`
    tokens of context drafting `drafts` each, `rows` target rows: the proposal (the profile's
    `propose_ms` at those drafts, linear in context between its points and log-linear in
    requests, flat outside) and the context write of the rows. -> {"forward_ms", "write_ms"}"""
    grid = [(k, c, ms) for k, c, d, ms in block["propose_ms"] if d == drafts]
    if not grid:  # (the deepest profiled drafts otherwise)
        deepest = max(d for _, _, d, _ in block["propose_ms"])
        grid = [(k, c, ms) for k, c, d, ms in block["propose_ms"] if d == deepest]
    counts = sorted({k for k, _, _ in grid})
    by_count = []
    for k in counts:
        pts = sorted((c, ms) for kk, c, ms in grid if kk == k)
        by_count.append(np.interp(context_len, [c for c, _ in pts], [ms for _, ms in pts]))
    forward = float(np.interp(np.log(num_spec), np.log(counts), by_count))
    write = np.asarray(block["context_write_ms"], dtype=np.float64)
    return {"forward_ms": forward, "write_ms": float(np.interp(rows, write[:, 0], write[:, 1]))}


def block_shares(record: dict, drafter: str) -> list[dict]:
    """Per (cohort, C <= SHARE_MAX_C) of the block drafter's all-spec runs: drafting's ms
    (`drafting_ms` at full depth, the runs' mean context) over the mean full-live step."""
    block = record["profile"].get("block_drafter")
    if not block:
        return []
    cfg = record["config"]
    depth = cfg["spec_depth"]
    context = cfg["prompt_len"] + cfg["max_tokens"] / 2
    out = []
    for r in record["summary"]:
        c = r["concurrency"]
        if r["policy"] != "all-spec" or r["drafter"] != drafter or c > SHARE_MAX_C:
            continue
        step = r.get("step_ms_full_live")
        if not step:
            continue
        ms = drafting_ms(block, c, context, depth - 1, c * depth)
        total = ms["forward_ms"] + ms["write_ms"]
        out.append(
            {
                "cohort": r["cohort"],
                "concurrency": c,
                **ms,
                "round_ms": step,
                "share": total / step,
            }
        )
    return sorted(out, key=lambda s: (s["cohort"], s["concurrency"]))


def block_targets(record: dict, drafter: str) -> dict:
    """The block drafter's targets, each with its worst case and its misses (within the run)."""
    points = [p for p in record["comparisons"] if p["drafter"] == drafter]

    def verdict(values: list[float], misses: list, bound: float, worst) -> dict:
        status = "not measured" if not values else ("met" if not misses else "missed")
        return {"status": status, "worst": worst(values) if values else None, "bound": bound,
                "misses": misses}  # fmt: skip

    c1 = [p for p in points if p["cohort"] == "code" and p["concurrency"] == 1]
    speed = [p["all-spec"] / p["all-ar"] for p in c1]
    best = [p["vs_best"] for p in points]
    cross = [p for p in points if p["crossover"]]
    both = [min(p["vs_ar"], p["vs_spec"]) for p in cross]
    shares = block_shares(record, drafter)
    return {
        "spec_vs_ar_c1_code": verdict(
            speed, [p for p, s in zip(c1, speed) if s < SPEEDUP_C1_CODE], SPEEDUP_C1_CODE, min
        ),
        "adaptive_vs_best": verdict(best, [p for p in points if p["vs_best"] < FLOOR], FLOOR, min),
        "adaptive_at_crossover": verdict(
            both, [p for p, b in zip(cross, both) if b < CROSS], CROSS, min
        ),
        "drafting_share": verdict(
            [s["share"] for s in shares],
            [s for s in shares if s["share"] > SHARE_BOUND],
            SHARE_BOUND,
            max,
        ),
        "shares": shares,
    }


def block_lines(record: dict) -> list[str]:
    """The report's block drafting section (nothing without a block drafter)."""
    block = record.get("block")
    if not block:
        return []
    t = block["targets"]
    names = {
        "spec_vs_ar_c1_code": f"all-spec >= {SPEEDUP_C1_CODE} x all-AR at C = 1 on code",
        "adaptive_vs_best": f"adaptive >= {FLOOR} x max(all-AR, all-spec) at every point",
        "adaptive_at_crossover": f"adaptive >= {CROSS} x both at each cohort's crossover",
        "drafting_share": f"drafting <= {SHARE_BOUND:.0%} of a speculating round at C <= "
        f"{SHARE_MAX_C}",
    }
    lines = [
        "",
        f"## Block drafter `{block['drafter']}`",
        "",
        "| target | status | worst | bound |",
        "|---|---|---:|---:|",
    ]
    for key, name in names.items():
        v = t[key]
        worst = "-" if v["worst"] is None else f"{v['worst']:.3f}"
        lines.append(f"| {name} | {v['status']} | {worst} | {v['bound']} |")
    lines += [
        "",
        "Drafting's share of a speculating round: the profile's block proposal (k = C requests, "
        "full depth, at the runs' mean context) plus its context write (C x spec depth rows), "
        "over the all-spec run's mean full-live step.",
        "",
        "| cohort | C | proposal ms | context write ms | step ms | share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {s['cohort']} | {s['concurrency']} | {s['forward_ms']:.3f} | {s['write_ms']:.3f} | "
        f"{s['round_ms']:.3f} | {100 * s['share']:.1f}% |"
        for s in t["shares"]
    ]
    return lines


def block_record(record: dict, drafter: str) -> dict | None:
    """The record's `block` entry: the block drafter's name and targets (None without one)."""
    if drafter == "none" or not record["profile"].get("block_drafter"):
        return None
    return {"drafter": drafter, "targets": block_targets(record, drafter)}
