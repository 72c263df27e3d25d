"""Re-derives a `hipfire-serve bench` record's figures from its step records.

    python -m loadtests.gpu_bench_rederive RECORD.json --out DIR

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

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from loadtests import gpu_bench_report as report
from loadtests.gpu_bench_runs import StepRecord, summarize_steps

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
    sims = {
        (r["policy"], r["drafter"], r["cohort"], r["concurrency"]): r["sim"]
        for r in record["summary"]
        if r.get("sim")
    }
    cfg = record["config"]
    summary = report.summarize(record["runs"], sims)
    points = [tuple(p) for p in cfg["points"]]
    comparisons = report.compare_policies(summary, points, cfg["concurrency"])
    record["summary"] = summary
    record["comparisons"] = comparisons
    record["targets"] = report.check_targets(
        comparisons, summary, record["roofline"], record["idle"]
    )
    if converted:
        record.setdefault("notes", []).append(
            "figures re-derived from the step records (python -m loadtests.gpu_bench_rederive): "
            "a decode round's tokens restored as one per request plus its accepted drafts"
        )
    record["step_tokens"] = STEP_TOKENS
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="gpu.json written with --keep-rounds")
    ap.add_argument("--out", required=True, help="folder for the re-derived record")
    args = ap.parse_args(argv)
    try:
        record = rederive(json.loads(Path(args.record).read_text()))
    except (OSError, ValueError, KeyError) as e:
        print(f"gpu_bench_rederive: {e!r}", file=sys.stderr)
        return 2
    for path in report.write_outputs(record, Path(args.out)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
