"""Re-derives a `hipfire-bench gpu` record's figures from its step records, or pools the runs
of several records of the same workload.

    python -m loadtests.lab.gpu.rederive RECORD.json [MORE.json ...] --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from loadtests.lab.gpu import report
from loadtests.lab.gpu.runs import StepRecord, summarize_steps

# The method, shown under `--help`.
METHOD = """\
Several records (benchmarks of the same workload, each within one call's time budget, so that
together they hold more repeats): every record kept with `--keep-rounds` is re-derived first,
then their runs are pooled, each record's repeats numbered after the previous record's. The
summary, comparisons and targets are computed over the pooled runs; the profile, roofline, GPU
idle and device are the first record's, and each point's simulator figures the first record's
that has them. A note lists the pooled records, and `pooled_records` keeps each one's own
adaptive / better fixed policy per point (a table in `gpu.md`), so that the spread between
calls is in view.

The record must keep every step (`--keep-rounds`). Each run's figures are recomputed from its
steps with the current accounting (`gpu_bench_runs.summarize_steps`), then the summary, the
comparisons, the targets, `gpu.md`, `gpu.json` and the plots are written again; the simulator's
figures, the roofline and the GPU idle measurement are kept as recorded. Nothing is measured.

Records written before `step_tokens` was "round" counted, per step, the outputs the step
returned: a round's tokens then sat in the step after it whenever its successor had been
launched before it finished, and at each speculating -> AR switch a speculating round's tokens
fell into a step without a round, outside the full-live figure. For such records a decode
round's tokens are restored from its step as one per request plus its accepted drafts (exact
for the benchmark's workload: `ignore_eos`, and drafts are capped by the tokens a request has
left); steps without a round get none. Finite refill figures (all tokens over the run) keep
their recorded values.
"""


STEP_TOKENS = "round"  # what a step's num_tokens counts in records written now


def round_tokens(step: StepRecord) -> StepRecord:
    """An older record's step with its round's tokens (see the module doc)."""
    if not step.route:
        return dataclasses.replace(step, num_tokens=0)
    if "P" in step.route:  # (prefill rounds: left as recorded; no full-live figure uses them)
        return step
    return dataclasses.replace(step, num_tokens=len(step.route) + step.num_accepted)


def rederive(record: dict) -> dict:
    """The record with its runs' figures, summary, comparisons and targets recomputed from
    the steps. Raises ValueError when a run kept no steps."""
    converted = record.get("step_tokens") != STEP_TOKENS
    for run in record["runs"]:
        if not run.get("steps"):
            raise ValueError(
                f"run {run['policy']} {run['drafter']} {run['cohort']} C={run['concurrency']} "
                "kept no steps (benchmark with --keep-rounds)"
            )
        steps = [StepRecord(**s) for s in run["steps"]]
        if converted:
            steps = [round_tokens(s) for s in steps]
        figures = summarize_steps(steps, run["concurrency"], run["run_s"])
        if converted:  # the whole run's tokens were right: keep them
            figures["num_tokens"], figures["refill_tok_s"] = run["num_tokens"], run["refill_tok_s"]
        run.update(figures)
        run["steps"] = [dataclasses.asdict(s) for s in steps]
    refigure(record, _sims(record))
    if converted:
        record.setdefault("notes", []).append(
            "figures re-derived from the step records (python -m loadtests.lab.gpu.rederive): "
            "a decode round's tokens restored as one per request plus its accepted drafts"
        )
    record["step_tokens"] = STEP_TOKENS
    return record


def _sims(record: dict) -> dict[tuple, dict]:
    """(policy, drafter, cohort, C) -> the record's simulator figures for that point."""
    return {
        (r["policy"], r["drafter"], r["cohort"], r["concurrency"]): r["sim"]
        for r in record["summary"]
        if r.get("sim")
    }


def refigure(record: dict, sims: dict[tuple, dict]) -> None:
    """The record's summary, comparisons and targets computed again from its runs and `sims`."""
    cfg = record["config"]
    summary = report.summarize(record["runs"], sims)
    points = [tuple(p) for p in cfg["points"]]
    comparisons = report.compare_policies(summary, points, cfg["concurrency"])
    record["summary"] = summary
    record["comparisons"] = comparisons
    record["targets"] = report.check_targets(
        comparisons, summary, record["roofline"], record["idle"]
    )


# What records must share to be pooled: the workload and the models.
SAME_WORKLOAD = (
    "model",
    "prompt_len",
    "max_tokens",
    "waves",
    "min_requests",
    "spec_depth",
    "max_prefill_tokens",
    "drafter_follows_prefill",
    "acceptance",
    "seed",
    "cold_estimator",
)
# what a record made before a SAME_WORKLOAD key existed did (before the estimator carried its
# knowledge between runs, every run started cold)
BEFORE_KEY = {"cold_estimator": True}


def pool(records: list[dict]) -> dict:
    """The runs of `records` in one record (see the module doc). Raises ValueError when the
    records' workloads differ."""
    first = records[0]
    for other in records[1:]:
        for key in SAME_WORKLOAD:
            a, b = (r["config"].get(key, BEFORE_KEY.get(key)) for r in (first, other))
            if a != b:
                raise ValueError(f"records differ in {key}: {a!r} against {b!r}")
        if other.get("step_tokens") != first.get("step_tokens"):
            raise ValueError("records count a step's tokens differently (re-derive them first)")
    pooled = dict(first)
    runs, skipped, sims, points, concurrency = [], [], {}, [], set()
    offset = 0
    for rec in records:
        repeats = [r["repeat"] for r in rec["runs"]] + [s["repeat"] for s in rec["skipped"]]
        runs += [{**r, "repeat": r["repeat"] + offset} for r in rec["runs"]]
        skipped += [{**s, "repeat": s["repeat"] + offset} for s in rec["skipped"]]
        offset += max(repeats, default=-1) + 1
        for key, sim in _sims(rec).items():
            sims.setdefault(key, sim)
        points += [p for p in rec["config"]["points"] if p not in points]
        concurrency |= set(rec["config"]["concurrency"])
    pooled["runs"], pooled["skipped"] = runs, skipped  # (each record's runs not made)
    # each record's own adaptive / better fixed policy, so a pooled figure's spread shows
    pooled["pooled_records"] = [
        {
            "label": f"{rec['device']} {rec['date']} ({len(rec['runs'])} runs)",
            "vs_best": [
                [c["drafter"], c["cohort"], c["concurrency"], c["vs_best"]]
                for c in rec.get("comparisons", [])
            ],
        }
        for rec in records
    ]
    pooled["config"] = {
        **first["config"],
        "points": points,
        "concurrency": sorted(concurrency),
        "repeats": offset,
    }
    pooled["notes"] = [
        *first.get("notes", []),
        "runs pooled from "
        + "; ".join(
            f"{rec['device']} {rec['date']} ({len(rec['runs'])} runs, "
            f"{rec.get('elapsed_s', 0):.0f} s)"
            for rec in records
        )
        + " (python -m loadtests.lab.gpu.rederive); profile, roofline and GPU idle from the "
        "first",
    ]
    refigure(pooled, sims)
    return pooled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="hipfire-bench rederive",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument(
        "records", nargs="+", help="gpu.json records (kept with --keep-rounds to re-derive)"
    )
    ap.add_argument("--out", required=True, help="folder for the re-derived or pooled record")
    args = ap.parse_args(argv)
    try:
        records = [json.loads(Path(p).read_text()) for p in args.records]
        if len(records) == 1:
            record = rederive(records[0])
        else:
            records = [
                rederive(r) if all(run.get("steps") for run in r["runs"]) else r for r in records
            ]
            record = pool(records)
    except (OSError, ValueError, KeyError) as e:
        print(f"gpu_bench_rederive: {e!r}", file=sys.stderr)
        return 2
    for path in report.write_outputs(record, Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
