"""Benchmark of the verify-pass kernels on one GPU; writes a JSON record and prints a table.

hipfire-bench kernels --out DIR [--tune] [--quick] [--tiles block_n=64,num_stages=2]
hipfire-bench kernels --out DIR --sweep [--variants rules|schedule|m32] [--shapes ...]
hipfire-bench kernels --out DIR --small-only             # norms, RoPE, top-k, accept
hipfire-bench kernels --render docs/perf/kernels.json   # Markdown tables of a record
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.testing

from kernels import arch
from kernels.attention import (
    fallback_fill_pct,
    merge_splits,
    plan_launch,
    verify_attention,
)
from loadtests.lab.kernels import compile as kernel_compile
from loadtests.lab.kernels.common import (
    BAD_REL_ERR,
    BATCHES,
    CONTEXTS,
    GQAS,
    HEAD_DIM,
    NUM_KV_HEADS,
    PAGE_SIZE,
    PICKED,
    REP_MS,
    ROWS,
    RULE_VARIANTS,
    SWEEP_PHASES,
    SWEEP_REP_MS,
    SWEEP_SETS,
    KvPool,
    bench_small_kernels,
    copy_bandwidth_tbps,
    sdpa_fn,
    set_attention_tiles,
    small_kernel_table,
    sweep_tasks,
    time_ms,
)

# The method, shown under `--help`.
METHOD = """\
Verify attention is timed at contexts 1k/8k/32k, rows per sequence 1/8/16, batch 1/16/64,
GQA 4 and 8 (8 KV heads, head_dim 128, bf16, 16-token pages scattered over the cache) against
(a) the same kernel forced to one row per program (every row re-reads the KV) and
(b) torch's scaled_dot_product_attention on KV already gathered into contiguous tensors (the
gather is not timed; GQA is folded into the query length so SDPA reads each KV head once).
Achieved KV bandwidth counts each sequence's K and V bytes once, and is compared with the copy
bandwidth (bytes read + written) of a large device-to-device copy measured in the same run.
Every timing is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph), which
also proves the kernels capture. `--tune` first sweeps tile settings in phases (SWEEP_PHASES),
each on the shapes its settings affect, adopts per class the setting of lowest geometric-mean
time, and runs the grid with the winners (the record's `attention_tiles` then say what to put
in the arch table); `--tiles` overrides entries of this GPU's arch-table tiles for the whole
run. Each shape's record carries its launch plan (tile, splits, warps, stages) and, for split
launches, the time of the merge kernel alone. `--sweep` checks the tile rules of
`plan_launch` instead of running the grid: per shape (RULE_SHAPES or `--shapes`) it times every
candidate launch the rules choose between (RULE_VARIANTS: 128- against 64- and 32-vector tiles,
2 against 3 stages, short contexts' short splits against 512-token ones) and the launch the
committed entry picks, each checked against SDPA, and writes sweep.json and sweep.md;
`--variants schedule` swaps in the 128-vector tile's schedule switches (SCHEDULE_VARIANTS) and
`--variants m32` the split rule's count of 32-vector programs per SM (M32_VARIANTS). Every
kernel variant is compiled first in parallel worker processes (`hipfire-bench kernels-compile`),
so the GPU machine's time goes to timing rather than to one-at-a-time compilation.
"""


def bench_attention_shape(
    pool: KvPool,
    batch,
    ctx,
    rows,
    gqa,
    copy_tbps,
    with_sdpa=True,
    with_per_row=True,
    rep_ms=REP_MS,
):
    q, cu, seq_lens, bt = pool.batch(batch, ctx, rows, gqa)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    out = torch.empty_like(q)

    def ours():
        return verify_attention(
            q, pool.k_cache, pool.v_cache, cu, seq_lens, bt, scale, out, max_q_len=rows
        )

    out_row = torch.empty_like(q)

    def per_row():
        return verify_attention(
            q, pool.k_cache, pool.v_cache, cu, seq_lens, bt, scale, out_row, rows_per_tile=1
        )

    ours()
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    rec = {"batch": batch, "ctx": ctx, "rows": rows, "gqa": gqa, "kv_bytes": kv_bytes}
    launch = plan_launch(
        q.device,
        num_rows=q.shape[0],
        num_seqs=batch,
        num_q_heads=q.shape[1],
        num_kv_heads=NUM_KV_HEADS,
        max_kv_len=bt.shape[1] * PAGE_SIZE,
        max_q_len=rows,
    )
    rec["launch"] = dataclasses.asdict(launch)
    rec["ours_ms"] = time_ms(ours, rep_ms)
    if launch.num_splits > 1 and with_per_row:
        # The merge kernel alone, on partials of the shape the split launch writes.
        part_out = torch.randn(launch.num_splits, *q.shape, device=q.device)
        part_lse = torch.randn(launch.num_splits, *q.shape[:2], device=q.device)
        merged = torch.empty_like(q)
        rec["merge_ms"] = time_ms(lambda: merge_splits(part_out, part_lse, merged, cu, batch))
        del part_out, part_lse
    if with_per_row:
        per_row()
        rec["per_row_ms"] = time_ms(per_row)
        rec["max_abs_diff_vs_per_row"] = float((out.float() - out_row.float()).abs().max())
    if with_sdpa:
        k, v = pool.gathered(bt, ctx)
        sdpa = sdpa_fn(q, k, v, rows, gqa, scale)
        ref = sdpa()  # [B, Hkv, rows*gqa, D]
        ref = ref.view(batch, NUM_KV_HEADS, rows, gqa, HEAD_DIM).permute(0, 2, 1, 3, 4)
        ref = ref.reshape(batch * rows, NUM_KV_HEADS * gqa, HEAD_DIM).float()
        rec["rel_err_vs_sdpa"] = float((out.float() - ref).norm() / ref.norm())
        rec["sdpa_ms"] = time_ms(sdpa)
        del k, v
    rec["ours_tbps"] = kv_bytes / (rec["ours_ms"] * 1e-3) / 1e12
    rec["ours_frac_copy"] = rec["ours_tbps"] / copy_tbps
    if with_per_row:
        rec["speedup_vs_per_row"] = rec["per_row_ms"] / rec["ours_ms"]
    if with_sdpa:
        rec["speedup_vs_sdpa"] = rec["sdpa_ms"] / rec["ours_ms"]
    return rec


def tune_phase(pool: KvPool, device: torch.device, copy_tbps: float, phase) -> list[dict]:
    """Times our kernel (no baselines) on each class's shapes under each of its changes,
    applied on top of the entry as it stands; the entry is restored afterwards."""
    base = arch.arch_config(device).attention
    results = []
    for klass, shapes, candidates in phase:
        for changes in candidates:
            set_attention_tiles(device, **changes)
            tiles = dataclasses.asdict(arch.arch_config(device).attention)
            for batch, ctx, rows, gqa in shapes:
                try:
                    rec = bench_attention_shape(
                        pool,
                        batch,
                        ctx,
                        rows,
                        gqa,
                        copy_tbps,
                        with_sdpa=False,
                        with_per_row=False,
                        rep_ms=SWEEP_REP_MS,
                    )
                except Exception as exc:
                    rec = {
                        "batch": batch,
                        "ctx": ctx,
                        "rows": rows,
                        "gqa": gqa,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                rec.update({"class": klass, "changes": changes, "tiles": tiles})
                results.append(rec)
            set_attention_tiles(device, **dataclasses.asdict(base))
    return results


def pick_winners(results: list[dict]) -> dict[str, dict]:
    """Per class, the change with the lowest geometric-mean time over the class's shapes.

    A change that failed on any shape is out; so is every change when the entry itself failed.
    """
    winners = {}
    for klass in dict.fromkeys(r.get("class", "") for r in results):
        by_change: dict[str, list[dict]] = {}
        for r in results:
            if r.get("class", "") == klass:
                by_change.setdefault(json.dumps(r["changes"], sort_keys=True), []).append(r)
        best, best_score = None, math.inf
        for key, recs in by_change.items():
            if any("ours_ms" not in r for r in recs):
                continue
            score = math.exp(sum(math.log(r["ours_ms"]) for r in recs) / len(recs))
            if score < best_score:
                best, best_score = json.loads(key), score
        if best is not None:
            winners[klass] = best
    return winners


def compiled_attention_variants(limit: int = 120) -> list[dict]:
    """Registers, spills and shared memory of every verify-attention binary loaded so far, with
    the specialisation key (tile constants, warps, stages) it was compiled for."""
    from kernels.attention import _verify_attention_kernel

    found = []
    try:
        for caches in _verify_attention_kernel.device_caches.values():
            for key, kernel in caches[0].items():
                meta = kernel.metadata
                found.append(
                    {
                        "regs": getattr(kernel, "n_regs", None),
                        "spills": getattr(kernel, "n_spills", None),
                        "shared": getattr(meta, "shared", None),
                        "num_warps": getattr(meta, "num_warps", None),
                        "num_stages": getattr(meta, "num_stages", None),
                        "key": str(key)[:2000],
                    }
                )
    except Exception as exc:  # Triton internals differ between versions: record, go on
        found.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
    return found[:limit]


def tune_table(results: list[dict]) -> str:
    """Markdown: per class, one line per change, % of copy bandwidth (time in us) per shape."""
    tables = []
    for klass in dict.fromkeys(r.get("class", "") for r in results):
        recs_of = [r for r in results if r.get("class", "") == klass]
        shapes = list(dict.fromkeys((r["batch"], r["ctx"], r["rows"], r["gqa"]) for r in recs_of))
        head = " | ".join(f"b{b} {c // 1024}k r{r} GQA{g}" for b, c, r, g in shapes)
        lines = [f"| {klass or 'change'} | {head} |", "|---|" + "---:|" * len(shapes)]
        by_change: dict[str, dict] = {}
        for r in recs_of:
            key = ", ".join(f"{k}={v}" for k, v in r["changes"].items()) or "(table entry)"
            by_change.setdefault(key, {})[(r["batch"], r["ctx"], r["rows"], r["gqa"])] = r
        for key, recs in by_change.items():
            cells = []
            for shape in shapes:
                r = recs.get(shape, {})
                if "ours_ms" in r:
                    cells.append(f"{100 * r['ours_frac_copy']:.1f}% ({r['ours_ms'] * 1e3:.0f})")
                else:
                    cells.append("error")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def launch_of(device: torch.device, batch: int, ctx: int, rows: int, gqa: int):
    """The launch `verify_attention` makes for a benchmark batch under the current entry."""
    return plan_launch(
        device,
        num_rows=batch * rows,
        num_seqs=batch,
        num_q_heads=NUM_KV_HEADS * gqa,
        num_kv_heads=NUM_KV_HEADS,
        max_kv_len=ctx,
        max_q_len=rows,
    )


def large_grid_fill_pct(device: torch.device, batch: int, ctx: int, rows: int, gqa: int) -> float:
    """Percent of the program slots the shape's grid of 128-vector tiles would fill as the
    fallback rule counts it (without splits at short contexts) under the current entry; 0 when
    the shape has smaller tiles."""
    base = arch.arch_config(device).attention
    set_attention_tiles(device, min_fill_pct_large=0)
    try:
        launch = launch_of(device, batch, ctx, rows, gqa)
    finally:
        set_attention_tiles(device, **dataclasses.asdict(base))
    if launch.block_m <= 64:
        return 0.0
    tiles = max(triton.cdiv(batch * rows, launch.rows_per_tile), batch)  # as plan_launch counts
    programs = tiles * NUM_KV_HEADS
    return fallback_fill_pct(device, launch.block_m, programs, launch.num_splits, ctx)


def rule_candidates(
    device: torch.device, shape: tuple[int, int, int, int], variants=RULE_VARIANTS
) -> list[dict]:
    """One entry per variant and one for the committed entry (last, label PICKED): label,
    changes, launch and `same_as`, the first earlier label with an identical launch (whose
    timing it shares), or None where the launch is new."""
    base = arch.arch_config(device).attention
    seen: dict[str, str] = {}
    found = []
    for label, changes in (*variants, (PICKED, {})):
        set_attention_tiles(device, **changes)
        try:
            launch = dataclasses.asdict(launch_of(device, *shape))
        finally:
            set_attention_tiles(device, **dataclasses.asdict(base))
        key = json.dumps(launch, sort_keys=True)
        same_as = seen.get(key)
        found.append({"label": label, "changes": changes, "launch": launch, "same_as": same_as})
        seen.setdefault(key, label)
    return found


def sweep_rule_shape(
    pool: KvPool, shape: tuple[int, int, int, int], copy_tbps: float, variants=RULE_VARIANTS
) -> dict:
    """Times every distinct candidate launch of one shape and checks its output against SDPA."""
    device = pool.device
    batch, ctx, rows, gqa = shape
    q, cu, seq_lens, bt = pool.batch(batch, ctx, rows, gqa)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    k, v = pool.gathered(bt, ctx)
    ref = sdpa_fn(q, k, v, rows, gqa, scale)()  # [B, Hkv, rows*gqa, D]
    ref = ref.view(batch, NUM_KV_HEADS, rows, gqa, HEAD_DIM).permute(0, 2, 1, 3, 4)
    ref = ref.reshape(batch * rows, NUM_KV_HEADS * gqa, HEAD_DIM).float()
    del k, v
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    rec = {
        "batch": batch,
        "ctx": ctx,
        "rows": rows,
        "gqa": gqa,
        "kv_bytes": kv_bytes,
        "large_fill_pct": large_grid_fill_pct(device, *shape),
    }
    base = arch.arch_config(device).attention
    candidates = rule_candidates(device, shape, variants)
    by_label: dict[str, dict] = {}
    for cand in candidates:
        if cand["same_as"] is not None:
            shared = by_label[cand["same_as"]]
            keys = ("ms", "frac_copy", "rel_err", "error")
            cand.update({k: shared[k] for k in keys if k in shared})
            by_label[cand["label"]] = cand
            continue
        set_attention_tiles(device, **cand["changes"])
        out = torch.full_like(q, float("nan"))

        def run(out=out):
            return verify_attention(
                q, pool.k_cache, pool.v_cache, cu, seq_lens, bt, scale, out, max_q_len=rows
            )

        try:
            run()
            cand["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            cand["ms"] = time_ms(run)
            cand["frac_copy"] = kv_bytes / (cand["ms"] * 1e-3) / 1e12 / copy_tbps
        except Exception as exc:  # recorded; the other candidates still run
            cand["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            set_attention_tiles(device, **dataclasses.asdict(base))
        by_label[cand["label"]] = cand
    rec["candidates"] = candidates
    picked = candidates[-1]
    if "ms" in picked:  # the pick (the entry as committed) timed again: this run's spread
        out = torch.empty_like(q)
        rec["picked_again_ms"] = time_ms(
            lambda: verify_attention(
                q, pool.k_cache, pool.v_cache, cu, seq_lens, bt, scale, out, max_q_len=rows
            )
        )
    timed = [c for c in candidates if "ms" in c]
    if timed:
        best = min(timed, key=lambda c: c["ms"])
        rec["best"] = best["label"] if best["same_as"] is None else best["same_as"]
        if "ms" in picked:
            rec["picked_vs_best"] = best["ms"] / picked["ms"]  # 1.0: the rule chose the best
    return rec


def _is_bad(candidate: dict) -> bool:
    """Failed to run, or off against SDPA (a NaN error counts as off)."""
    return "error" in candidate or not candidate.get("rel_err", math.nan) <= BAD_REL_ERR


def rule_sweep_failures(records: list[dict]) -> list[str]:
    """Candidates that failed to run or whose output is off against SDPA."""
    bad = []
    for r in records:
        for c in r["candidates"]:
            if _is_bad(c):
                bad.append(f"b{r['batch']} {r['ctx']} r{r['rows']} GQA{r['gqa']} {c['label']}")
    return bad


def _launch_text(launch: dict) -> str:
    return f"{launch['block_m']} vec, {launch['num_splits']} spl, {launch['num_stages']} st"


def _shape_text(r: dict) -> str:
    ctx = f"{r['ctx'] // 1024}k" if r["ctx"] % 1024 == 0 else str(r["ctx"])
    return f"b{r['batch']} {ctx} r{r['rows']} GQA{r['gqa']}"


def _timing_text(c: dict) -> str:
    if "ms" not in c:
        return "error"
    return f"{100 * c['frac_copy']:.1f}% ({c['ms'] * 1e3:.1f})"


def rule_sweep_table(records: list[dict]) -> str:
    """Markdown: per shape the committed pick against the best candidate, then every distinct
    launch with the candidates that make it (tile = query vectors per program, splits, stages)."""
    lines = [
        "| shape | 128-vec fill | picked | % of copy (us) | again (us) | best | % of copy (us) "
        "| best / picked time |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in records:
        by_label = {c["label"]: c for c in r["candidates"]}
        picked = by_label[PICKED]
        best = by_label.get(r.get("best", ""), {})
        fill = f"{r['large_fill_pct']:.0f}%" if r["large_fill_pct"] else "-"
        again = f"{r['picked_again_ms'] * 1e3:.1f}" if "picked_again_ms" in r else "-"
        ratio = f"{r['picked_vs_best']:.3f}" if "picked_vs_best" in r else "-"
        best_launch = _launch_text(best["launch"]) if best else "-"
        lines.append(
            f"| {_shape_text(r)} | {fill} | {_launch_text(picked['launch'])} "
            f"| {_timing_text(picked)} | {again} | {best_launch} | {_timing_text(best)} "
            f"| {ratio} |"
        )
    lines += [
        "",
        "| shape | launch | candidates | % of copy (us) | rel. err vs SDPA |",
        "|---|---|---|---:|---:|",
    ]
    for r in records:
        for c in r["candidates"]:
            if c["same_as"] is not None:
                continue
            same = [d for d in r["candidates"] if c["label"] in (d["label"], d["same_as"])]
            names = [d["label"] for d in same]
            err = f"{c['rel_err']:.1e}" if "rel_err" in c else c.get("error", "")[:80]
            if _is_bad(c):
                err += " BAD"
            lines.append(
                f"| {_shape_text(r)} | {_launch_text(c['launch'])} | {'; '.join(names)} "
                f"| {_timing_text(c)} | {err} |"
            )
    return "\n".join(lines)


def run_rule_sweep(
    device: torch.device,
    out_dir: Path,
    shapes: list[tuple[int, int, int, int]],
    record: dict,
    variants=RULE_VARIANTS,
) -> int:
    """`--sweep`: compiles every distinct candidate launch in parallel, then times them shape by
    shape; writes sweep.json (after every shape) and sweep.md. Exit status 1 when a candidate
    failed or was off against SDPA."""

    record["sweep_shapes"] = shapes
    record["sweep_variants"] = [list(v) for v in variants]
    record["sweep_rep_ms"] = REP_MS
    pairs = []
    for shape in shapes:
        for cand in rule_candidates(device, shape, variants):
            if cand["same_as"] is None:
                pairs.append((cand["changes"], (shape,)))
    record["sweep_compile"] = kernel_compile.compile_all(device, [], pairs, small=False)
    print("compile", json.dumps(record["sweep_compile"]), flush=True)
    pool = KvPool(device, max(batch * ctx for batch, ctx, _, _ in shapes))
    record["sweep"] = []
    for shape in shapes:
        rec = sweep_rule_shape(pool, shape, record["copy_tbps"], variants)
        record["sweep"].append(rec)
        print("sweep", json.dumps(rec), flush=True)
        (out_dir / "sweep.json").write_text(json.dumps(record, indent=1))
    table = rule_sweep_table(record["sweep"])
    failures = rule_sweep_failures(record["sweep"])
    note = (
        f"{record['gpu']} {record['date_utc']} UTC, copy {record['copy_tbps']:.3f} TB/s; "
        f"% of copy bandwidth (us), median of CUDA-graph replays of {REP_MS} ms"
    )
    text = f"{note}\n\n{table}\n"
    if failures:
        text += "\nFAILED (error or rel. error > 1e-2 against SDPA): " + "; ".join(failures) + "\n"
    (out_dir / "sweep.md").write_text(text)
    print(text, flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="hipfire-bench kernels",
        description=__doc__.splitlines()[0],
    )
    ap.add_argument("--out", type=Path, help="folder for kernels.json")
    ap.add_argument("--render", type=Path, help="print a record's tables as Markdown and exit")
    ap.add_argument("--tune", action="store_true", help="sweep attention tile settings first")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 16, 8k and 32k only")
    ap.add_argument("--tiles", default="", help="arch-table tile changes: block_n=64,num_stages=2")
    ap.add_argument("--no-baselines", action="store_true", help="skip the full grid (tune only)")
    ap.add_argument(
        "--small-only", action="store_true", help="only the small kernels (norms, RoPE, top-k...)"
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="time the tile rules' candidate launches and the committed pick (sweep.json/.md)",
    )
    ap.add_argument(
        "--variants",
        choices=sorted(SWEEP_SETS),
        default="rules",
        help="candidate set of --sweep: the tile rules' (default) or the 128-vector schedules",
    )
    ap.add_argument(
        "--shapes",
        default="",
        help="shapes of --sweep as BATCHxCTXxROWSxGQA, comma-separated (default RULE_SHAPES)",
    )
    args = ap.parse_args(argv)
    if args.render:
        print(markdown_tables(json.loads(args.render.read_text())))
        return 0
    if args.out is None:
        ap.error("--out is required")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    record = {
        "gpu": props.name,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "num_sms": props.multi_processor_count,
        "arch_family": arch.arch_config(device).family,
    }
    tile_changes = parse_tiles(args.tiles)
    if tile_changes:
        set_attention_tiles(device, **tile_changes)
        record["tile_changes"] = tile_changes
    record["copy_tbps"] = copy_bandwidth_tbps(device)
    print(f"{record['gpu']}  copy (read+write) {record['copy_tbps']:.3f} TB/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        record["attention_tiles"] = dataclasses.asdict(arch.arch_config(device).attention)
        variants, default_shapes = SWEEP_SETS[args.variants]
        shapes = parse_shapes(args.shapes) or list(default_shapes)
        return run_rule_sweep(device, args.out, shapes, record, variants)

    def save() -> None:  # after every stage, so a run cut short still leaves its numbers
        (args.out / "kernels.json").write_text(json.dumps(record, indent=1))

    if args.small_only:
        record["small_kernels"] = bench_small_kernels(device)
        save()
        print(small_kernel_table(record["small_kernels"]))
        return 0
    shapes = [(b, c, r, g) for c in CONTEXTS for b in BATCHES for r in ROWS for g in GQAS]
    if args.quick:
        shapes = [s for s in shapes if s[0] in (1, 16) and s[1] in (8192, 32768)]
    if args.no_baselines:
        shapes = []

    pool = KvPool(device, max(BATCHES) * max(CONTEXTS))
    if args.tune:
        record["tune"], record["tune_compile"], record["tune_adopted"] = [], [], []
        for phase in SWEEP_PHASES:
            compiled = kernel_compile.compile_all(device, [], sweep_tasks(phase), small=False)
            record["tune_compile"].append(compiled)
            print("compile", json.dumps(compiled), flush=True)
            results = tune_phase(pool, device, record["copy_tbps"], phase)
            record["tune"] += results
            winners = pick_winners(results)
            record["tune_adopted"].append(winners)
            adopted = {k: v for changes in winners.values() for k, v in changes.items()}
            set_attention_tiles(device, **adopted)  # later phases and the grid run with them
            print(tune_table(results), "\nadopted", json.dumps(winners), flush=True)
            save()
        record["tune_binaries"] = compiled_attention_variants()
    record["attention_tiles"] = dataclasses.asdict(arch.arch_config(device).attention)
    print("attention tiles", json.dumps(record["attention_tiles"]), flush=True)
    save()
    if args.no_baselines:
        return 0
    record["compile"] = kernel_compile.compile_all(device, shapes, (), small=True)
    print("compile", json.dumps(record["compile"]), flush=True)
    record["attention"] = []
    for batch, ctx, rows, gqa in shapes:
        rec = bench_attention_shape(pool, batch, ctx, rows, gqa, record["copy_tbps"])
        record["attention"].append(rec)
        print("attn", json.dumps(rec), flush=True)
        save()
    del pool
    torch.cuda.empty_cache()
    record["small_kernels"] = bench_small_kernels(device)
    save()
    print_table(record)
    return 0


def parse_tiles(text: str) -> dict[str, int]:
    """'block_n=64,num_stages=2' -> {'block_n': 64, 'num_stages': 2}; names are checked."""
    fields = {f.name for f in dataclasses.fields(arch.AttentionTiles)}
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in fields:
            raise ValueError(f"unknown tile field {name!r}; known: {sorted(fields)}")
        changes[name] = int(value)
    return changes


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'16x8192x16x8,1x1024x16x8' -> [(16, 8192, 16, 8), (1, 1024, 16, 8)]: batch, context,
    rows per sequence, GQA; the context a multiple of the page size."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = tuple(int(x) for x in item.lower().split("x"))
        if len(fields) != 4 or min(fields) < 1 or fields[1] % PAGE_SIZE:
            raise ValueError(f"shape {item!r}: want BATCHxCTXxROWSxGQA, CTX a multiple of 16")
        shapes.append(fields)
    return shapes


def markdown_tables(record: dict) -> str:
    """The attention and small-kernel tables of a record, as Markdown."""
    lines = [
        "| ctx | batch | rows | GQA | tile | splits | ours us | KV TB/s | % of copy | per-row us "
        "| x per-row | SDPA us | x SDPA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["attention"]:
        launch = r.get("launch", {})
        lines.append(
            f"| {r['ctx']} | {r['batch']} | {r['rows']} | {r['gqa']} "
            f"| {launch.get('block_m', '')} | {launch.get('num_splits', '')} "
            f"| {r['ours_ms'] * 1e3:.1f} "
            f"| {r['ours_tbps']:.2f} | {100 * r['ours_frac_copy']:.1f} "
            f"| {r['per_row_ms'] * 1e3:.1f} | {r['speedup_vs_per_row']:.2f} "
            f"| {r['sdpa_ms'] * 1e3:.1f} | {r['speedup_vs_sdpa']:.2f} |"
        )
    merged = [r for r in record["attention"] if "merge_ms" in r]
    if merged:
        lines += [
            "",
            "| ctx | batch | rows | GQA | splits | ours us | merge alone us | merge share |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in merged:
            lines.append(
                f"| {r['ctx']} | {r['batch']} | {r['rows']} | {r['gqa']} "
                f"| {r['launch']['num_splits']} | {r['ours_ms'] * 1e3:.1f} "
                f"| {r['merge_ms'] * 1e3:.1f} | {100 * r['merge_ms'] / r['ours_ms']:.0f}% |"
            )
    lines += ["", small_kernel_table(record["small_kernels"])]
    # A sweep of this run, or of a separate --tune run kept in the record under "tune_run".
    sweep = record.get("tune") or record.get("tune_run", {}).get("tune")
    if sweep:
        lines += ["", tune_table(sweep)]
    return "\n".join(lines)


def print_table(record: dict) -> None:
    print(f"\n{record['gpu']} {record['date_utc']}  copy {record['copy_tbps']:.2f} TB/s")
    print(" ctx  batch rows gqa  m spl |  ours us  TB/s  %copy | per-row us  x | sdpa us  x | err")
    for r in record["attention"]:
        launch = r.get("launch", {})
        print(
            f"{r['ctx']:>5} {r['batch']:>5} {r['rows']:>4} {r['gqa']:>3} "
            f"{launch.get('block_m', 0):>3} {launch.get('num_splits', 0):>3} | "
            f"{r['ours_ms'] * 1e3:8.1f} {r['ours_tbps']:5.2f} {100 * r['ours_frac_copy']:5.1f} | "
            f"{r['per_row_ms'] * 1e3:9.1f} {r['speedup_vs_per_row']:5.2f} | "
            f"{r['sdpa_ms'] * 1e3:7.1f} {r['speedup_vs_sdpa']:5.2f} | {r['rel_err_vs_sdpa']:.1e}"
        )
    for r in record["small_kernels"]:
        print(
            f"{r['kernel']:<45} {r['ours_ms'] * 1e3:8.1f} us  torch {r['torch_ms'] * 1e3:8.1f}"
            f" us  x{r['speedup']:.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
