"""`hipfire-bench gpu`: the end-to-end engine benchmark. Adaptive speculation against all-AR
and all-spec (and the simulator's other baselines) on real-shaped random-weight models, against
the roofline and against the simulator's prediction. Uses project internals (engine, scheduler,
executor, simulator); no HTTP.

    hipfire-bench gpu --out OUT            # the GPU run: Qwen3-8B-shaped target
    hipfire-bench gpu --quick --out OUT    # the same pipeline on `random:tiny` (CPU tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lab.cli_args import int_tuple
from loadtests.lab.gpu import report
from loadtests.lab.gpu.block import block_record
from loadtests.lab.gpu.config import (
    QUICK,
    REAL_POLICIES,
    RESERVE_FRACTION,
    SIM_POLICIES,
    BenchConfig,
)
from loadtests.lab.gpu.measure import (
    add_round_phases,
    measure_idle,
    measure_profile,
    roofline_curve,
    simulate,
)
from loadtests.lab.gpu.runs import (
    build_engine,
    cost_inners,
    recover,
    run_grid,
    warm_graphs,
    warm_runs,
)
from scheduler.sim.cli import PROFILES

# The method, shown under `--help`.
METHOD = """\
One run, in order:
1. one engine: the target, the `synthetic` drafter (acceptance from the shared acceptance models,
   cohorts code / prose / mixed) wrapping a real drafter whose cost every round pays (the
   Qwen3-0.6B-shaped draft model, a block drafter (`random-block:qwen3-8b-dflash`: the engine
   then captures the target's hidden states and every forward writes its context; a draft
   model is then built beside it), or ngram);
2. the cost profile of that engine (`build_profile` of `hipfire_serve/cost_profile/`, copy
   bandwidth and bf16 GEMM rate measured in the same call), and per other cost drafter its
   own speculating host time and round factor (`drafter_spec_terms`, kept under
   `profile.by_drafter`; a draft model beside a block drafter also its `draft_model` section,
   on the target's terms less the block drafter's context write); the scheduler's cost model
   and the simulator read them;
3. round time over rows x KV length against the roofline max(bytes / copy BW, FLOPs / GEMM rate)
   (shapes over 1.3 x re-timed phase by phase), the decode graphs the runs replay captured
   ahead (target and draft model), two unmeasured all-spec runs (kernels compiled on first
   use), and GPU idle in the engine loop at C = 64 (torch profiler);
4. the refill workload at each C: C slots, a finished request replaced at once while the source
   has requests, `waves * C` requests (at least `--min-requests`), prompts of ~`--prompt-len`
   tokens (uniform in [len/2, 3 len/2], the simulator's workload), `--max-tokens` outputs each,
   `ignore_eos`, greedy; per (policy, C, cohort, drafter), `--repeats` times. The engine's models,
   KV cache and captured graphs are reused: each run installs a fresh scheduler (the policy,
   with a fresh cost model) and a fresh synthetic drafter (so every policy sees the same
   acceptance traces); all-AR uses no drafter and runs once per C;
5. the same workloads through the simulator with the measured profile;
6. report: terminal table, `gpu.md`, `gpu.json` and PNG plots in `--out`.

Figures (the loadgen's definitions, on engine steps instead of streams): full-live tokens/s = the
tokens of the steps whose round ran all C requests decoding (route of C letters, no prefill)
over those steps' wall time; finite refill tokens/s = all tokens over the whole run, drain
included. `--time-budget-s` (default 500 s) bounds the whole call: runs are made repeat-major,
so every point gets its first repeat before any gets a second, and a run whose expected length
(from the runs before it) would pass the budget is skipped and listed; a run that raises is
listed with its error and the engine drained, so the others still count.
"""


# -- command line ------------------------------------------------------------------------------
def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


# flag -> (BenchConfig field, parser); every flag defaults to the preset's value
FLAGS = {
    "--model": ("model", str),
    "--drafters": ("drafters", _names),
    "--cohorts": ("cohorts", _names),
    "--other-cohorts": ("other_cohorts", _names),
    "--concurrency": ("concurrency", int_tuple),
    "--other-concurrency": ("other_concurrency", int_tuple),
    "--policies": ("policies", _names),
    "--sim-policies": ("sim_policies", _names),
    "--prompt-len": ("prompt_len", int),
    "--max-tokens": ("max_tokens", int),
    "--waves": ("waves", int),
    "--min-requests": ("min_requests", int),
    "--repeats": ("repeats", int),
    "--spec-depth": ("spec_depth", int),
    "--max-prefill-tokens": ("max_prefill_tokens", int),
    "--profile-rows": ("profile_rows", int_tuple),
    "--profile-kv-lens": ("profile_kv_lens", int_tuple),
    "--profile-repeats": ("profile_repeats", int),
    "--idle-concurrency": ("idle_concurrency", int),
    "--idle-rounds": ("idle_rounds", int),
    "--time-budget-s": ("time_budget_s", float),
    "--sim-seeds": ("sim_seeds", int),
    "--kv-cache-memory": ("kv_cache_memory", str),
    "--device": ("device", str),
    "--dtype": ("dtype", str),
    "--seed": ("seed", int),
    "--acceptance": ("acceptance", str),
    "--workers": ("workers", int),
}
HELP = {
    "--drafters": "cost drafters, comma-separated: at most one draft model (random:NAME or a "
    "directory), at most one block drafter (random-block:NAME or a directory), 'ngram', 'none'",
    "--other-concurrency": "concurrencies of the drafters after the first (default: the same)",
    "--cohorts": "acceptance cohorts of the first drafter",
    "--other-cohorts": "acceptance cohorts of the drafters after the first",
    "--policies": f"run on the engine, from: {', '.join(REAL_POLICIES)}",
    "--sim-policies": f"run in the simulator, from: {', '.join(SIM_POLICIES)}",
    "--min-requests": "requests per run at least (else waves x C)",
    "--time-budget-s": "wall-clock bound of the whole call; runs that would not fit are skipped",
    "--sim-seeds": "simulator runs per point (their mean is the prediction)",
    "--workers": "simulator processes; 0: one per CPU, at most 16",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="hipfire-bench gpu",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    ap.add_argument("--quick", action="store_true", help="small CPU preset (random:tiny)")
    ap.add_argument("--out", required=True, help="folder for gpu.md, gpu.json and the plots")
    ap.add_argument("--keep-rounds", action="store_true", help="every step's record in the JSON")
    ap.add_argument(
        "--cold-estimator",
        action="store_true",
        help="every run's scheduler starts at the configured acceptance prior (default: the runs "
        "of a repeat, policy, drafter and cohort carry what the estimator learned from each "
        "concurrency to the next, as a server whose load rises on that traffic)",
    )
    ap.add_argument(
        "--drafter-follows-prefill",
        choices=("off", "on", "auto"),
        default=None,
        help="the draft model computes prefill chunks' KV in their rounds: off (default), on, "
        "or auto (prompts whose following the policy's speculation on the live batch, every "
        "request decoding with its drafter caught up, would pay back); the all-AR baseline "
        "never does",
    )
    for flag, (name, _) in FLAGS.items():
        default = getattr(BenchConfig, name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        ap.add_argument(flag, default=None, help=f"{HELP.get(flag, name)} (default {shown})")
    return ap


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = QUICK if args.quick else BenchConfig()
    changes = {}
    for flag, (name, parse) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[name] = parse(value)
    if args.keep_rounds:
        changes["keep_rounds"] = True
    if args.cold_estimator:
        changes["cold_estimator"] = True
    if args.drafter_follows_prefill is not None:
        changes["drafter_follows_prefill"] = args.drafter_follows_prefill
    cfg = dataclasses.replace(cfg, **changes)
    unknown = [p for p in cfg.policies if p not in REAL_POLICIES]
    unknown += [p for p in cfg.sim_policies if p not in SIM_POLICIES]
    if unknown:
        raise ValueError(f"unknown or simulator-only policies: {', '.join(unknown)}")
    if not cfg.drafters or not cfg.concurrency or cfg.repeats < 1 or cfg.sim_seeds < 1:
        raise ValueError("need drafters, concurrency values, --repeats >= 1, --sim-seeds >= 1")
    if min(cfg.concurrency) < 1 or cfg.prompt_len < 2 or cfg.max_tokens < 1:
        raise ValueError("--concurrency >= 1, --prompt-len >= 2 and --max-tokens >= 1")
    cfg.block_drafter, cfg.chain_drafter  # noqa: B018  (validates: at most one of each)
    return cfg


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"hipfire-bench gpu: {e}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    import torch

    deadline = t_start + cfg.time_budget_s * (1.0 - RESERVE_FRACTION)
    try:
        engine = build_engine(cfg)
    except (ValueError, OSError) as e:
        print(f"hipfire-bench gpu: {e}", file=sys.stderr)
        return 2
    model_inner = cost_inners(engine, cfg)  # the cost drafters with a model, by name
    device = engine.device
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"engine ready on {dev_name}: {cfg.model}, cost drafters {', '.join(cfg.drafters)}")
    with tempfile.TemporaryDirectory() as tmp:
        profile, paths = measure_profile(engine, cfg, Path(tmp), model_inner)
        log(f"profile measured: ceilings {profile.get('ceilings') or 'none (no GPU)'}")
        roofline = roofline_curve(engine, profile)
        notes = []  # set-up steps that failed or were left out, without stopping the benchmark
        try:
            # the runs are what counts: extras before them get a share of the budget only
            extras_deadline = t_start + 0.3 * cfg.time_budget_s
            num = add_round_phases(engine, cfg, roofline, extras_deadline)
            log(f"{num} shapes over 1.3 x roofline re-timed")
        except Exception as e:
            notes.append(f"phase timing of the roofline misses failed: {e!r}")
        try:
            log(f"{warm_graphs(engine, cfg, model_inner)} decode graphs captured ahead of the runs")
        except Exception as e:  # the runs capture lazily instead
            notes.append(f"graph warm-up failed: {e!r}")
        try:
            log(f"{warm_runs(engine, cfg, paths, model_inner)} unmeasured warm-up runs made")
        except Exception as e:
            notes.append(f"warm-up runs failed: {e!r}")
            if not recover(engine):
                notes.append("the engine could not be drained after them")
        engine.freeze_heap()  # the set-up stays out of the collector's scans during the runs
        idle = {}
        try:
            if time.perf_counter() < t_start + 0.4 * cfg.time_budget_s:
                idle = measure_idle(engine, cfg, paths, model_inner)
            else:
                notes.append("GPU idle not measured: the set-up took 40% of the time budget")
        except Exception as e:
            notes.append(f"GPU idle measurement failed: {e!r}")
            if not recover(engine):
                notes.append("the engine could not be drained after it")
        if idle:
            fractions = {k: round(v["gpu_idle_fraction"], 3) for k, v in idle.items()}
            log(f"GPU idle at C={cfg.idle_concurrency}: {fractions}")
        for note in notes:
            log(note)
        from loadtests.lab.compile_log import CompileLog

        compiles = CompileLog().install()
        try:
            runs, skipped = run_grid(engine, cfg, paths, model_inner, deadline, log, compiles)
        finally:
            compiles.uninstall()
        for run in runs:
            c = run.get("compiles") or {}
            if c.get("count"):
                log(
                    f"{run['policy']} {run['drafter']} {run['cohort']} C={run['concurrency']}: "
                    f"{c['count']} Triton compilations ({c['seconds']} s): {c['kernels']}"
                )
        log(f"{len(runs)} runs done, {len(skipped)} skipped; simulating")
        sims = simulate(cfg, paths, engine.target.config.vocab_size)
    summary = report.summarize(runs, sims)
    comparisons = report.compare_policies(summary, cfg.points(), cfg.concurrency)
    targets = report.check_targets(comparisons, summary, roofline, idle)
    config = dataclasses.asdict(cfg)
    config["points"] = cfg.points()
    root = PROFILES.parents[1]
    if Path(cfg.acceptance).resolve().is_relative_to(root):  # no machine paths in the record
        config["acceptance"] = str(Path(cfg.acceptance).resolve().relative_to(root))
    record = {
        "device": dev_name,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "config": config,
        "profile": profile,
        "roofline": roofline,
        "idle": idle,
        "targets": targets,
        "comparisons": comparisons,
        "summary": summary,
        "runs": runs,
        "skipped": skipped,
        "notes": notes,
        "step_tokens": "round",  # a step's num_tokens: its rounds' tokens (gpu_bench_rederive)
        "elapsed_s": time.perf_counter() - t_start,
    }
    record["block"] = block_record(record, cfg.block_drafter)
    print(report.comparison_table(comparisons))
    for key in (
        "adaptive_vs_best",
        "adaptive_at_crossover",
        "roofline",
        "gpu_idle_c64",
        "simulator",
    ):
        t = targets[key]
        worst = "-" if t["worst"] is None else f"{t['worst']:.3f}"
        print(f"target {key}: {t['status']} (worst {worst}, bound {t['bound']})")
    for key, t in ((record.get("block") or {}).get("targets") or {}).items():
        if key != "shares":
            worst = "-" if t["worst"] is None else f"{t['worst']:.3f}"
            print(f"block target {key}: {t['status']} (worst {worst}, bound {t['bound']})")
    paths_out = report.write_outputs(record, Path(args.out))
    log(f"wrote {', '.join(p.name for p in paths_out)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
