"""Does the adaptive policy hold against the better fixed policy? A grid through the simulator.

For every profile variant (`profile_variant`), cohort and concurrency C the GPU benchmark's
refill workload (its simulator task: C slots, max(2C, 4) requests, prompts uniform in
[512, 1536], 128 output tokens, prefill budget 2048, decide_ahead) runs under adaptive, all-AR
and all-spec for several seeds (`sim_chain`), and the mean full-live tokens/s are compared:
every point needs adaptive >= FLOOR x max(all-AR, all-spec), each (variant, cohort)'s crossover
C (where all-AR and all-spec are closest) adaptive >= CROSSOVER_GAIN x both (`compare`).

    python -m scheduler.sim.policy_check --profile docs/perf/gpu.json --acceptance \
        scheduler/profiles/acceptance.json

Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scheduler.cost_model import ProfileCost
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.runner import RefillBench, SimSetup, run_sim

FLOOR = 0.98
CROSSOVER_GAIN = 1.05
POLICIES = ("adaptive", "all-ar", "all-spec")
VARIANTS = ("measured", "draft-half", "ngram")
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
COHORTS = ("code", "prose", "mixed")


@dataclass(frozen=True)
class CheckConfig(RefillBench):
    """The benchmark's refill workload, and the simulator seeds to average over."""

    seeds: int = 3
    seed: int = 0
    cold: bool = False  # every run starts from the configured prior (no carried knowledge)


def load_profile(path: str | Path, key: str = "profile") -> dict:
    """A cost profile JSON, or a record holding one under `key` (as docs/perf/gpu.json does)."""
    data = json.loads(Path(path).read_text())
    if "target" not in data and key in data:
        data = data[key]
    if "target" not in data:
        raise ValueError(f"{path}: no cost profile (a 'target' section) at the top or '{key}'")
    return data


def profile_variant(profile: dict, variant: str) -> dict:
    """`measured`: as is; `draft-half`: draft-model step times x 0.5 (a faster draft chain);
    `ngram`: no draft model (drafting costs no device time in the cost model, as the benchmark
    builds its n-gram profile)."""
    p = dict(profile)
    if variant == "measured":
        return p
    if variant == "ngram":
        p.pop("draft_model", None)
        return p
    if variant == "draft-half":
        draft = dict(p["draft_model"])
        draft["rows_ms_per_step"] = [[r, ms * 0.5] for r, ms in draft["rows_ms_per_step"]]
        p["draft_model"] = draft
        return p
    raise ValueError(f"unknown profile variant {variant!r} (one of {', '.join(VARIANTS)})")


def sim_chain(task: tuple) -> list[dict]:
    """One seed of one policy over the concurrencies in rising order, set up as the GPU
    benchmark's simulator task does; with `carry`, each run starts from what the one before
    learned of the drafter (`SimSetup.acceptance`: prior, evidence, calibration), as a server
    whose load rises on the same traffic keeps it and as the benchmark's runs do; the first C
    starts at the configured prior (`--cold`: every run does)."""
    profile, acceptance, cohort, policy, concurrency, cfg, seed, carry = task
    cost, classes = ProfileCost(profile), load_cohorts(acceptance)[cohort]
    out, known = [], None
    for c in concurrency:
        result = run_sim(
            cost,
            classes,
            SimSetup(
                policy=policy,
                concurrency=c,
                spec_depth=cfg.spec_depth,
                seed=seed,
                max_prefill_tokens=cfg.max_prefill_tokens,
                decide_ahead=True,
                acceptance=known,
            ),
            cfg.workload(c),
        )
        known = result.acceptance if carry else None
        out.append(
            {
                "full_live_tok_s": result.full_live_tok_s,
                "refill_tok_s": result.refill_tok_s,
                "spec_share_full_live": result.route_mix_full_live.get("S", 0.0),
            }
        )
    return out


def run_points(
    profile: dict,
    acceptance: str,
    cohorts: tuple[str, ...],
    concurrency: tuple[int, ...],
    cfg: CheckConfig,
    workers: int = 0,
) -> dict[tuple[str, str, int], dict]:
    """(policy, cohort, C) -> seed-mean full-live tok/s (None if a seed had no full-live
    round), refill tok/s and adaptive's speculating share of full-live request-rounds. Each
    (policy, cohort, seed) runs its concurrencies in rising order, carrying the estimator's
    knowledge from run to run unless `cfg.cold`."""
    concurrency = tuple(sorted(concurrency))
    chains = [(pol, co, s) for co in cohorts for pol in POLICIES for s in range(cfg.seeds)]
    tasks = [
        (profile, acceptance, co, pol, concurrency, cfg, cfg.seed + s, not cfg.cold)
        for pol, co, s in chains
    ]
    workers = workers or min(os.cpu_count() or 1, 16)
    if workers == 1:
        results = [sim_chain(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(sim_chain, tasks))
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for (pol, co, _), chain in zip(chains, results):
        for c, r in zip(concurrency, chain):
            runs.setdefault((pol, co, c), []).append(r)
    out = {}
    for key, seeds in runs.items():
        full = [r["full_live_tok_s"] for r in seeds]
        out[key] = {
            "full_live_tok_s": None if None in full else float(np.mean(full)),
            "refill_tok_s": float(np.mean([r["refill_tok_s"] for r in seeds])),
            "spec_share": float(np.mean([r["spec_share_full_live"] for r in seeds])),
        }
    return out


def compare(points: dict, cohorts, concurrency) -> list[dict]:
    """Per (cohort, C): the three rates on one metric and adaptive / max(fixed); then per cohort
    the crossover C and adaptive / min over (AR, spec) there. A point where some policy has no
    full-live round (at large C the refill workload may never run all slots decode-only) is
    compared on refill tokens/s instead and marked `*`; each row also shows the three refill
    rates (the whole run: prefills, catch-ups and drain, where a drafter's catch-up on a whole
    prompt is often paid, which full-live leaves out)."""
    rows = []
    for co in cohorts:
        cohort_rows = []
        for c in concurrency:
            rec = {pol: points[(pol, co, c)] for pol in POLICIES}
            full = all(rec[p]["full_live_tok_s"] is not None for p in POLICIES)
            metric = "full_live_tok_s" if full else "refill_tok_s"
            rate = {p: rec[p][metric] for p in POLICIES}
            best = max(rate["all-ar"], rate["all-spec"])
            cohort_rows.append(
                {
                    "cohort": co,
                    "concurrency": c,
                    "metric": metric,
                    **rate,
                    "refill": {p: rec[p]["refill_tok_s"] for p in POLICIES},
                    "adaptive_spec_share": rec["adaptive"]["spec_share"],
                    "ratio": rate["adaptive"] / best if best > 0 else float("inf"),
                    "floor_ok": rate["adaptive"] >= FLOOR * best,
                    "crossover": False,
                }
            )
        gaps = [abs(np.log(r["all-ar"] / r["all-spec"])) for r in cohort_rows]
        cross = cohort_rows[int(np.argmin(gaps))]
        cross["crossover"] = True
        cross["crossover_ratio"] = cross["adaptive"] / min(cross["all-ar"], cross["all-spec"])
        cross["crossover_ok"] = cross["adaptive"] >= CROSSOVER_GAIN * max(
            cross["all-ar"], cross["all-spec"]
        )
        rows += cohort_rows
    return rows


def format_table(variant: str, rows: list[dict]) -> str:
    lines = [
        f"profile {variant}",
        f"{'cohort':7s} {'C':>4s} {'adaptive':>9s} {'all-AR':>9s} {'all-spec':>9s} "
        f"{'ad/best':>8s} {'spec%':>6s} {'refill ad/AR/spec':>22s}  check",
    ]
    for r in rows:
        note = "" if r["floor_ok"] else f"  < {FLOOR}"
        if r["crossover"]:
            gain = r["adaptive"] / max(r["all-ar"], r["all-spec"])
            ok = "ok" if r["crossover_ok"] else "MISS"
            note += f"  crossover: {gain:.3f} x better fixed (target {CROSSOVER_GAIN}) {ok}"
        star = "*" if r["metric"] != "full_live_tok_s" else " "
        lines.append(
            f"{r['cohort']:7s} {r['concurrency']:4d} {r['adaptive']:9.1f} {r['all-ar']:9.1f} "
            f"{r['all-spec']:9.1f} {r['ratio']:8.3f}{star}{r['adaptive_spec_share'] * 100:6.1f} "
            + "{:>22s}".format("/".join(f"{r['refill'][p]:.0f}" for p in POLICIES))
            + note
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", required=True, help="cost profile JSON, or a record holding one")
    p.add_argument("--profile-key", default="profile", help="key of the profile in a record")
    p.add_argument("--acceptance", required=True, help="acceptance cohorts JSON")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--cohorts", default=",".join(COHORTS))
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--workers", type=int, default=0, help="processes; 0: one per CPU")
    p.add_argument(
        "--cold",
        action="store_true",
        help="every run starts at the configured acceptance prior (default: a (policy, cohort, "
        "seed) carries what its estimator learned from each C to the next, as the benchmark)",
    )
    p.add_argument("--floor-only", action="store_true", help="exit status ignores crossovers")
    p.add_argument("--json", help="write every point here")
    args = p.parse_args(argv)
    base = load_profile(args.profile, args.profile_key)
    cohorts = tuple(v for v in args.cohorts.split(",") if v)
    concurrency = tuple(int(v) for v in args.concurrency.split(",") if v)
    cfg = CheckConfig(seeds=args.seeds, seed=args.seed, cold=args.cold)
    record = {}
    missed = 0
    for variant in (v for v in args.variants.split(",") if v):
        profile = profile_variant(base, variant)
        points = run_points(profile, args.acceptance, cohorts, concurrency, cfg, args.workers)
        rows = compare(points, cohorts, concurrency)
        print(format_table(variant, rows), flush=True)
        missed += sum(not r["floor_ok"] for r in rows)
        if not args.floor_only:
            missed += sum(r["crossover"] and not r["crossover_ok"] for r in rows)
        record[variant] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"{missed} target(s) missed" if missed else "all targets met")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
