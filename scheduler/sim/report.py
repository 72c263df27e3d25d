"""Regenerates docs/perf/scheduler.md and docs/perf/scheduler.json.

    python -m scheduler.sim.report            # full grid (minutes on 2 cores)
    python -m scheduler.sim.report --grid-json FILE   # reuse a `simulate --out` grid

Runs every policy on the shared H200 profile and acceptance models (refill workload, depth 8,
C = 1..256, cohorts code/prose/mixed), checks the targets, benchmarks plan() at C = 256 with 64
waiting, and measures tenant fairness under saturation. All ratios compare runs of the same
grid (same seed, same requests, same acceptance draws per token position).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

from scheduler.cost_model import ProfileCost
from scheduler.sim.baselines import POLICY_NAMES
from scheduler.sim.cli import PROFILES, format_table
from scheduler.sim.fairness import run_saturated
from scheduler.sim.grid import run_grid
from scheduler.sim.plan_bench import bench_plan
from scheduler.tenants import TenantSpec

REPO = Path(__file__).resolve().parents[2]
CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
COHORTS = ["code", "prose", "mixed"]
BASELINES = ["all-ar", "all-spec", "threshold", "goodput", "sticky", "survival"]


def _index(rows: list[dict]) -> dict[tuple[str, int, str], dict]:
    return {(r["cohort"], r["concurrency"], r["policy"]): r for r in rows}


def crossover(rows: dict, cohort: str) -> list[int]:
    """The grid points around the crossing of all-AR and all-spec: the two neighbours where
    the faster fixed mode changes, or the point of nearest approach when one mode wins
    everywhere."""

    def log_gap(c: int) -> float:
        ar = rows[(cohort, c, "all-ar")]["full_live_tok_s"]
        spec = rows[(cohort, c, "all-spec")]["full_live_tok_s"]
        return math.log(ar / spec)

    gaps = [log_gap(c) for c in CONCURRENCIES]
    for i in range(len(gaps) - 1):
        if (gaps[i] < 0) != (gaps[i + 1] < 0):
            return [CONCURRENCIES[i], CONCURRENCIES[i + 1]]
    return [min(CONCURRENCIES, key=lambda c: abs(log_gap(c)))]


def check_targets(rows: dict) -> dict:
    checks: dict = {"per_cohort": {}, "misses": []}
    for cohort in COHORTS:
        crossing = crossover(rows, cohort)
        per_c = {}
        for c in CONCURRENCIES:
            tok = {p: rows[(cohort, c, p)]["full_live_tok_s"] for p in POLICY_NAMES}
            a = tok["adaptive"]
            ratios = {p: a / tok[p] for p in POLICY_NAMES if p != "adaptive"}
            per_c[c] = ratios
            best_fixed = max(tok["all-ar"], tok["all-spec"])
            if a < 0.98 * best_fixed:
                checks["misses"].append(
                    f"{cohort} C={c}: adaptive {a / best_fixed:.3f} x max(all-AR, all-spec) "
                    "(target >= 0.98)"
                )
            if a < 0.93 * tok["true-state"]:
                checks["misses"].append(
                    f"{cohort} C={c}: adaptive {ratios['true-state']:.3f} x true-state "
                    "(target >= 0.93)"
                )
            above = [p for p in POLICY_NAMES if p != "clairvoyant" and tok[p] > tok["clairvoyant"]]
            if above:
                checks["misses"].append(
                    f"{cohort} C={c}: above clairvoyant's per-round best: {', '.join(above)}"
                )
            for p in BASELINES:
                if ratios[p] < 0.99:
                    checks["misses"].append(
                        f"{cohort} C={c}: adaptive {ratios[p]:.3f} x {p} (target >= 0.99)"
                    )
        for cx in crossing:
            at_cx = per_c[cx]
            if min(at_cx["all-ar"], at_cx["all-spec"]) < 1.05:
                checks["misses"].append(
                    f"{cohort} crossover C={cx}: adaptive {at_cx['all-ar']:.3f} x all-AR, "
                    f"{at_cx['all-spec']:.3f} x all-spec (target >= 1.05 x both)"
                )
        checks["per_cohort"][cohort] = {"crossover": crossing, "ratios": per_c}
    return checks


def closest_margins(rows: dict, checks: dict) -> list[str]:
    """The tightest grid point of every check, passing or not."""
    best_fixed, true_state, bound, others = [], [], [], []
    crossings = []
    for cohort in COHORTS:
        per_c = checks["per_cohort"][cohort]["ratios"]
        for c, r in per_c.items():
            best_fixed.append((min(r["all-ar"], r["all-spec"]), cohort, c))
            true_state.append((r["true-state"], cohort, c))
            bound.append((r["clairvoyant"], cohort, c))
            others.extend((r[p], cohort, c, p) for p in BASELINES)
        crossings.extend(
            f"{cohort} C={cx}: {per_c[cx]['all-ar']:.3f} x all-AR, "
            f"{per_c[cx]['all-spec']:.3f} x all-spec"
            for cx in checks["per_cohort"][cohort]["crossover"]
        )
    v, cohort, c = min(best_fixed)
    lines = [f"vs max(all-AR, all-spec): lowest {v:.3f} ({cohort} C={c}) (target 0.98)"]
    lines.append("at the crossovers (target 1.05): " + "; ".join(crossings))
    v, cohort, c = min(true_state)
    lines.append(f"vs true-state: lowest {v:.3f} ({cohort} C={c}) (target 0.93)")
    v, cohort, c = min(bound)
    lines.append(f"vs clairvoyant: lowest {v:.3f} ({cohort} C={c})")
    v, cohort, c, p = min(others)
    lines.append(f"vs any other baseline: lowest {v:.3f} x {p} ({cohort} C={c}) (target 0.99)")
    return lines


def miss_notes(rows: dict, checks: dict) -> list[str]:
    """For every point where adaptive trails a baseline, how true-state fares there: if it
    trails it too, the gap is in the planner's objective, not in estimation."""
    notes = []
    for cohort in COHORTS:
        for c, ratios in checks["per_cohort"][cohort]["ratios"].items():
            for p in BASELINES:
                if ratios[p] >= 0.99:
                    continue
                true_state = rows[(cohort, c, "true-state")]["full_live_tok_s"]
                base = rows[(cohort, c, p)]["full_live_tok_s"]

                def s_share(policy: str, cohort=cohort, c=c) -> float:
                    return rows[(cohort, c, policy)]["route_mix_full_live"].get("S", 0.0)

                notes.append(
                    f"- {cohort} C={c}: {p} reaches {base:.0f} tokens/s, true-state "
                    f"{true_state:.0f} ({true_state / base:.3f} x {p}), adaptive "
                    f"{ratios[p]:.3f} x {p}. Share of request-rounds speculating: {p} "
                    f"{s_share(p):.2f}, true-state {s_share('true-state'):.2f}, adaptive "
                    f"{s_share('adaptive'):.2f}. "
                    + (
                        "true-state (same planner, true acceptance state) is below it too, "
                        "so the gap comes mostly from the per-round planner, not from "
                        "estimating acceptance."
                        if true_state < base
                        else "true-state is above it, so the gap comes from estimating acceptance."
                    )
                )
    return notes


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_markdown(payload: dict) -> str:
    rows = _index(payload["results"])
    checks = payload["checks"]
    params = payload["params"]
    bench = payload["plan_bench"]
    fair = payload["fairness"]
    out: list[str] = []
    out.append("# Scheduler policy results (simulator)")
    out.append("")
    out.append(
        "Generated by `python -m scheduler.sim.report` (tables and JSON in "
        "`docs/perf/scheduler.json`). The real `Scheduler` runs against the simulated "
        "executor: round times from the cost profile "
        f"(`{params['profile']}`, {params['noise']:.0%} log-normal noise on every measured "
        f"round), acceptance from `{params['acceptance']}` (two-state easy/hard chain per "
        "request, the same draws per token position for every policy). Workload: refill "
        f"(closed loop, waves of C), max(16, 3C) requests of {params['max_tokens']} tokens, "
        f"prompts uniform in [{params['prompt_len'] // 2}, {params['prompt_len'] * 3 // 2}] "
        f"tokens, spec depth {params['spec_depth']} (7 drafts), seed {params['seed']}."
    )
    out.append("")
    out.append(
        "**Full-live tokens/s** counts only rounds in which all C slots decode (no prefill "
        "in the round): the steady state the targets are about. Refill tokens/s is all "
        "tokens over the whole run, prefill waves and the final drain included."
    )
    out.append("")
    out.append("## Targets")
    out.append("")
    if checks["misses"]:
        out.append(f"{len(checks['misses'])} target point(s) missed:")
        out.append("")
        out.extend(f"- {m}" for m in checks["misses"])
    else:
        out.append("All target checks pass at every grid point.")
    out.append("")
    out.append("The targets:")
    out.append("")
    out.append(
        "- adaptive >= 0.98 x max(all-AR, all-spec) at every point; >= 1.05 x both at the "
        "crossover (the two grid points where the faster fixed mode changes, or the point "
        "of nearest approach when one mode wins everywhere);"
    )
    out.append(
        "- adaptive >= 0.93 x true-state; adaptive >= 0.99 x every other baseline; no policy "
        "above clairvoyant (the best depths of every round given its true outcomes)."
    )
    out.append("")
    out.append("Closest points of each check:")
    out.append("")
    out.extend(f"- {line}" for line in closest_margins(rows, checks))
    out.append("")
    for cohort in COHORTS:
        cx = checks["per_cohort"][cohort]["crossover"]
        where = " / ".join(str(c) for c in cx)
        out.append(f"## {cohort}: full-live tokens/s (crossover C = {where}, marked x)")
        out.append("")
        others = [p for p in POLICY_NAMES if p != "adaptive"]
        out.append(
            "| C | all-AR | all-spec | adaptive | true-state | clairvoyant | adaptive / "
            + " | / ".join(others)
            + " | S share | acc len |"
        )
        out.append("|" + "---|" * (8 + len(others)))
        for c in CONCURRENCIES:
            r = {p: rows[(cohort, c, p)] for p in POLICY_NAMES}
            a = r["adaptive"]
            ratio = checks["per_cohort"][cohort]["ratios"][c]
            out.append(
                f"| {c}{' (x)' if c in cx else ''} | {_fmt(r['all-ar']['full_live_tok_s'])} | "
                f"{_fmt(r['all-spec']['full_live_tok_s'])} | {_fmt(a['full_live_tok_s'])} | "
                f"{_fmt(r['true-state']['full_live_tok_s'])} | "
                f"{_fmt(r['clairvoyant']['full_live_tok_s'])} | "
                + " | ".join(f"{ratio[p]:.3f}" for p in others)
                + f" | {a['route_mix_full_live'].get('S', 0):.2f} | "
                f"{_fmt(a['mean_accepted_len'], 2)} |"
            )
        out.append("")
    out.append("## Refill tokens/s (whole run, drain included)")
    out.append("")
    out.append("| cohort | C | " + " | ".join(POLICY_NAMES) + " |")
    out.append("|" + "---|" * (2 + len(POLICY_NAMES)))
    for cohort in COHORTS:
        for c in CONCURRENCIES:
            vals = " | ".join(_fmt(rows[(cohort, c, p)]["refill_tok_s"]) for p in POLICY_NAMES)
            out.append(f"| {cohort} | {c} | {vals} |")
    out.append("")
    errs = [r["mean_abs_pred_error"] for r in payload["results"] if r["policy"] == "adaptive"]
    out.append(
        f"Predicted vs measured round time (adaptive runs): mean absolute error "
        f"{sum(errs) / len(errs):.1%} averaged over the grid, against "
        f"{params['noise']:.0%} injected noise."
    )
    out.append("")
    out.append("## plan() cost")
    out.append("")
    out.append(
        f"`python -m scheduler.sim.plan_bench`: C = {bench['concurrency']} decoding requests, "
        f"{bench['num_waiting']} waiting, adaptive policy, {bench['num_rounds']} rounds, one "
        f"process on {payload['machine']}."
    )
    out.append("")
    runs = bench.get("runs_plan_us_median", [bench["plan_us_median"]])
    out.append(
        "| median us/round | mean | p90 | of which the depth decision (median) "
        "| medians of all runs |"
    )
    out.append("|---|---|---|---|---|")
    out.append(
        f"| {bench['plan_us_median']:.0f} | {bench['plan_us_mean']:.0f} | "
        f"{bench['plan_us_p90']:.0f} | {bench['decide_us_median']:.0f} | "
        + ", ".join(f"{r:.0f}" for r in sorted(runs))
        + " |"
    )
    out.append("")
    out.append(
        f"The table shows the run with the median of {len(runs)} runs (one process each, "
        "one after another)."
    )
    out.append("")
    target_note = (
        "meets"
        if bench["plan_us_median"] < 100
        else f"misses by {bench['plan_us_median'] / 100:.0f}x"
    )
    out.append(
        f"The target of < 100 us per round {target_note}. The depth decision takes "
        f"{bench['decide_us_median']:.0f} us of it, the rest of plan() (release, admission, KV "
        "blocks, the policy's view, the plan's columns) the other "
        f"{bench['plan_us_median'] - bench['decide_us_median']:.0f} us. " + PLAN_COST_NOTE
    )
    out.append("")
    out.append("## Tenant fairness (saturated)")
    out.append("")
    out.append(
        f"{fair['concurrency']} slots, tenants with weights "
        + ", ".join(f"{n} = {w:g}" for n, w in fair["weights"].items())
        + f", every tenant always backlogged, {fair['num_rounds']} rounds:"
    )
    out.append("")
    out.append("| tenant | weight share | slot-time share |")
    out.append("|---|---|---|")
    for name in fair["weights"]:
        out.append(f"| {name} | {fair['weight_share'][name]:.3f} | {fair['share'][name]:.3f} |")
    out.append("")
    out.append(f"Jain's index over slot-time / weight: {fair['jain_index']:.4f}.")
    out.append("")
    out.append("## Notes")
    out.append("")
    out.extend(miss_notes(rows, checks))
    out.append(NOTES)
    out.append("")
    return "\n".join(out)


PLAN_COST_NOTE = (
    "Decoding requests keep what the policy and the plan need (committed length, drafter "
    "lag, mode and since when, tokens left, KV blocks held) in per-slot arrays that update() "
    "changes with array operations, and the plan carries the decode rows as columns "
    "(`DecodeRows`), so the bookkeeping has no per-request objects; what remains per request "
    "is appending new KV block ids to the pool's per-request lists for the requests that "
    "cross a block boundary this round. The code before this layout (one `ReqPlan` per "
    "request, a Python loop per live request in plan() and update()) measured medians of "
    "831, 831, 834, 836 and 846 us per round (depth decision 433 us) in 5 runs of this "
    "benchmark on the same machine, just before the change. The depth decision is unchanged "
    "(every simulator result above is identical to the one before the change): one stable "
    "sort of the n x 7 draft positions and, per chain cap, a dozen array operations over "
    "that cap's ranked positions. It is now most of plan(); inside the benchmark loop the "
    "sort alone takes about 90 us (the simulator's work between rounds leaves the caches "
    "cold). Two exact variants were tried on the rounds of this benchmark and dropped: all "
    "caps in one [7, n x 7] grid (the same choices, 626 against 309 us per call at C = 256 "
    "when the calls are replayed, 123 against 147 us at C = 64) and skipping a cap by an "
    "upper bound from the cumulative value of the whole ranking and the fewest rows a "
    "prefix can have (it pruned no cap in 314 rounds: the bound ignores how rows grow with "
    "the prefix). Reaching 100 us needs a search that does not evaluate every prefix of "
    "every cap and KV block tables held as arrays; this code has neither."
)

NOTES = """\
- The planner decides one round at a time. A uniform depth for everyone (threshold,
  goodput) keeps every request speculating and its drafter caught up; the planner moves
  requests in and out of speculation (the speculating shares above) and relies on the
  amortised catch-up charge (`scheduler/policy.py`) to value staying caught up.
- The policy maximises `expected tokens - rate_bar x predicted ms` per round, where
  `rate_bar` is the realised long-run rate relative to the batch's all-AR rate (floored at
  the AR rate), learned from decode-only rounds. Maximising each round's own tokens/ms
  instead compares a draft position with the rate of that very round: it over-speculates
  while requests are in hard stretches and under-speculates in easy ones (see
  `scheduler/depth_planner.py`).
- true-state uses the same planner with the true hidden state and the true cost curve; the
  remaining gap to it is the cost of estimating acceptance from outcomes. clairvoyant also
  knows each round's outcomes and takes the best depths of every round (oracles.py): a bound
  per round, not over a run (it plans no round for the next), so a policy above it is a
  reading to explain, and the report lists it.
- Mixed cohort at C = 256 is the closest point: one draft for every request fills the
  512-row graph bucket and sits near break-even against AR while contexts are short.
  Three estimation and pricing biases kept the whole batch in AR there for a long stretch
  after each wave of prefills (218 of 560 full-live rounds), and every AR round grew the
  drafter's catch-up, which made the way back dearer: the rate bar also learned from
  prefill rounds (1.9x the AR rate, where drafts ride on an eager prefill forward), the
  global prior learned from whole chains (first-position survival 0.64 against 0.66
  observed on first positions over the same rounds) and the amortised catch-up was
  rounded up to a whole row per request and round. With the bar from decode-only rounds,
  the prior from first positions and the catch-up rounded to nearest, 93 of 449 full-live
  rounds there are all-AR.
- `threshold` uses the cohort's true mean acceptance from the acceptance file for its
  offline table, so it is a strong baseline on the single-class cohorts."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--grid-json", default="", help="reuse this `simulate --out` grid")
    p.add_argument("--profile", default=str(PROFILES / "h200-qwen3-8b.json"))
    p.add_argument("--acceptance", default=str(PROFILES / "acceptance.json"))
    p.add_argument("--out-dir", default=str(REPO / "docs" / "perf"))
    p.add_argument("--bench-rounds", type=int, default=300)
    p.add_argument("--bench-repeats", type=int, default=5, help="plan() benchmark runs")
    args = p.parse_args(argv)
    params = {
        "profile": "scheduler/profiles/h200-qwen3-8b.json",
        "acceptance": "scheduler/profiles/acceptance.json",
        "max_tokens": 512,
        "prompt_len": 128,
        "spec_depth": 8,
        "seed": 0,
        "noise": 0.03,
        "workload": "refill",
    }
    if args.grid_json:
        grid = json.loads(Path(args.grid_json).read_text())
        results = grid["results"]
    else:
        results = run_grid(
            args.profile,
            args.acceptance,
            COHORTS,
            CONCURRENCIES,
            list(POLICY_NAMES),
            max_tokens=params["max_tokens"],
            prompt_len=params["prompt_len"],
            spec_depth=params["spec_depth"],
            seed=params["seed"],
            noise_sigma=params["noise"],
        )
    print(format_table(results))
    # The machine may be shared: repeat the benchmark and report the median run and the spread.
    bench_runs = [
        bench_plan(
            256, 64, args.bench_rounds, profile_path=args.profile, acceptance_path=args.acceptance
        )
        for _ in range(max(args.bench_repeats, 1))
    ]
    bench = sorted(bench_runs, key=lambda b: b["plan_us_median"])[len(bench_runs) // 2]
    bench = dict(bench, runs_plan_us_median=[b["plan_us_median"] for b in bench_runs])
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    fair = run_saturated(
        ProfileCost.from_file(args.profile),
        [TenantSpec(n, w) for n, w in weights.items()],
        concurrency=24,
        lengths=[8, 40, 16, 120, 24, 64],
        num_rounds=1500,
    )
    fair.update({"weights": weights, "concurrency": 24, "num_rounds": 1500})
    payload = {
        "params": params,
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        "results": results,
        "plan_bench": bench,
        "fairness": fair,
    }
    payload["checks"] = check_targets(_index(results))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scheduler.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out_dir / "scheduler.md").write_text(render_markdown(payload))
    print(f"plan(): {bench['plan_us_median']:.0f} us median per round at C=256, 64 waiting")
    print(f"fairness: Jain {fair['jain_index']:.4f}")
    print("misses:" if payload["checks"]["misses"] else "all targets met")
    for m in payload["checks"]["misses"]:
        print(f"  {m}")
    print(f"wrote {out_dir / 'scheduler.md'} and {out_dir / 'scheduler.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
