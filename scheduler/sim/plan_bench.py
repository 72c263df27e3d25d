"""Benchmark of Scheduler.plan(): C live decoding requests with a backlog waiting.

Steady state of a full server: every slot decodes, the backlog cannot be admitted. Each round
is planned (timed), executed by the simulator and fed back (not timed). Prints microseconds per
plan() (median and mean) and the share spent in the policy's depth decision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.executor import SimExecutor
from scheduler.sim.runner import distinct_prompt

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def bench_plan(
    concurrency: int = 256,
    num_waiting: int = 64,
    num_rounds: int = 300,
    spec_mode: str = "adaptive",
    cohort: str = "mixed",
    profile_path: str | Path = PROFILES / "h200-qwen3-8b.json",
    acceptance_path: str | Path = PROFILES / "acceptance.json",
    decide_ahead: bool = False,
) -> dict:
    """With `decide_ahead`, each round's next decision is made after plan() (untimed), the way
    the engine makes it while the device runs the round (Scheduler.prepare_decision): the timed
    plan() is then the host's critical path between two rounds."""
    profile = ProfileCost.from_file(profile_path)
    classes = load_cohorts(acceptance_path)[cohort]
    cfg = SchedulerConfig(max_concurrency=concurrency, spec_mode=spec_mode, spec_depth=8)
    sched = Scheduler(cfg, concurrency * 64 + 1, CostModel(profile))
    executor = SimExecutor(profile, classes, concurrency, seed=0)
    max_tokens = 100_000  # nobody finishes during the benchmark
    for i in range(concurrency + num_waiting):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=distinct_prompt(i, 128),
                sampling=SamplingSpec(),
                max_tokens=max_tokens,
            )
        )
    now = 0.0
    while sched.stats.num_decoding < concurrency:  # prefill everyone first
        result = executor.run(sched.plan(now))
        now += result.timings.total_ms / 1e3
        sched.update(result, now)
    policy = sched.policy
    decide = policy.decide
    decide_s: list[float] = []

    in_plan = [False]

    def timed_decide(*args):
        t0 = time.perf_counter()
        out = decide(*args)
        if in_plan[0]:  # decisions made ahead (outside plan()) are not on the critical path
            decide_s.append(time.perf_counter() - t0)
        return out

    policy.decide = timed_decide
    plan_s: list[float] = []
    num_ahead = 0
    for _ in range(num_rounds):
        in_plan[0] = True
        t0 = time.perf_counter()
        plan = sched.plan(now)
        plan_s.append(time.perf_counter() - t0)
        in_plan[0] = False
        num_ahead += plan.reason.endswith("(ahead)")
        if decide_ahead:
            sched.prepare_decision()
        result = executor.run(plan)
        now += result.timings.total_ms / 1e3
        sched.update(result, now)
    policy.decide = decide
    assert sched.num_waiting == num_waiting and sched.num_running == concurrency
    plan_us = np.array(plan_s) * 1e6
    decide_us = np.array(decide_s) * 1e6 if decide_s else np.zeros(1)
    return {
        "concurrency": concurrency,
        "num_waiting": num_waiting,
        "spec_mode": spec_mode,
        "decide_ahead": decide_ahead,
        "rounds_decided_ahead": num_ahead,
        "num_rounds": num_rounds,
        "plan_us_median": float(np.median(plan_us)),
        "plan_us_mean": float(plan_us.mean()),
        "plan_us_p90": float(np.percentile(plan_us, 90)),
        "decide_us_median": float(np.median(decide_us)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--waiting", type=int, default=64)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--spec-mode", default="adaptive", choices=("adaptive", "spec", "ar"))
    p.add_argument(
        "--decide-ahead",
        action="store_true",
        help="make each next decision outside the timed plan(), as the engine's loop does",
    )
    args = p.parse_args(argv)
    out = bench_plan(
        args.concurrency, args.waiting, args.rounds, args.spec_mode, decide_ahead=args.decide_ahead
    )
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
