"""The two workloads that exercise prefix caching, run from the command line.

`shared-prefix` sends groups of requests that share a long system prompt (shared_prefix.py),
closed loop at `--concurrency` or open loop at `--rate`; `multi-turn` runs conversations whose
turns resend the growing history (conversation.py, multi_turn.py). Every run of one invocation
draws its own texts (the seed advanced by the run's index), so a run never finds the previous
run's prompts in the server's cache; the server keeps its cache between invocations, so a cold
start needs a `--seed` not used before against it. Warm-up requests draw texts of their own.
"""

from __future__ import annotations

import argparse
import math
import time

from loadtests import breakdown, results
from loadtests.conversation import MultiTurnConfig, build_scripts
from loadtests.multi_turn import run_multi_turn
from loadtests.run_setup import (
    client_config,
    http_client,
    measured_run,
    report_header,
    settings_from,
)
from loadtests.runners import run_poisson, run_refill
from loadtests.shared_prefix import SharedPrefixConfig, plan_shared_prefix

RUN_SEED_STEP = 1_000_003  # texts of run k are drawn from seed + k * RUN_SEED_STEP
WARMUP_SEED = 10_000_019  # warm-up texts: seed + WARMUP_SEED


def _add_parts(run: dict, records, workload: str) -> dict:
    run["ttft_split"] = breakdown.ttft_split(records, workload)
    if workload == "multi-turn":
        run["turns"] = breakdown.by_turn(records)
    return run


async def run_shared_prefix(args: argparse.Namespace) -> tuple[dict, list]:
    settings = settings_from(args)
    spec = SharedPrefixConfig(
        num_groups=args.num_groups, system_prompt_len=args.system_prompt_len,
        question_len=args.question_len, num_requests=args.num_requests,
    )  # fmt: skip
    spec.check()
    closed = not args.rate
    mode = "refill" if closed else "poisson"
    report = report_header(args, settings, mode, f"shared-prefix-{mode}")
    report.update(workload="shared-prefix", endpoint=args.endpoint, shared_prefix=vars(spec))
    if not closed:
        report["burstiness"] = args.burstiness
    per_run = []
    async with http_client(args) as http:
        cfg = await client_config(http, args, settings, args.endpoint)
        report["model"] = cfg.model
        for k, value in enumerate(args.concurrency if closed else args.rate):
            seed = args.seed + k * RUN_SEED_STEP
            if args.warmup:
                warm_spec = SharedPrefixConfig(**{**vars(spec), "num_requests": args.warmup})
                warm = plan_shared_prefix(warm_spec, settings.tenants, seed + WARMUP_SEED)
                warm_c = min(args.warmup, value) if closed else args.warmup
                await run_refill(http, cfg, warm, warm_c, time.perf_counter, lambda r: None)
            requests = plan_shared_prefix(spec, settings.tenants, seed)

            async def run(clock, on_done, value=value, requests=requests, seed=seed):
                if closed:
                    return await run_refill(http, cfg, requests, value, clock, on_done)
                return await run_poisson(
                    http, cfg, requests, value, args.burstiness, seed, clock, on_done,
                    args.max_in_flight or None,
                )  # fmt: skip

            title = f"C={value}" if closed else f"rate={value:g}"
            records, server = await measured_run(http, settings, args, len(requests), title, run)
            summary = results.summarize_run(
                records, mode=mode, concurrency=value if closed else None,
                rate=None if closed or math.isinf(value) else value,
                slo=settings.slo, server=server,
            )  # fmt: skip
            report["runs"].append(_add_parts(summary, records, "shared-prefix"))
            per_run.append((summary, records))
    return report, per_run


async def run_multi_turn_load(args: argparse.Namespace) -> tuple[dict, list]:
    settings = settings_from(args)
    spec = MultiTurnConfig(
        num_conversations=args.num_conversations, num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len, user_len=args.user_len,
        num_system_prompts=args.num_system_prompts,
    )  # fmt: skip
    spec.check()
    if args.think_time < 0:
        raise ValueError("--think-time must be >= 0")
    report = report_header(args, settings, "multi-turn", "multi-turn")
    report.update(workload="multi-turn", endpoint="chat", multi_turn=vars(spec),
                  think_time_s=args.think_time)  # fmt: skip
    per_run = []
    async with http_client(args) as http:
        cfg = await client_config(http, args, settings, "chat")
        report["model"] = cfg.model
        for k, concurrency in enumerate(args.concurrency):
            seed = args.seed + k * RUN_SEED_STEP
            if args.warmup:
                warm_spec = MultiTurnConfig(**{**vars(spec), "num_conversations": args.warmup})
                await run_multi_turn(
                    http, cfg, build_scripts(warm_spec, seed + WARMUP_SEED),
                    min(args.warmup, concurrency), time.perf_counter, lambda r: None,
                    tenants=settings.tenants, seed=seed + WARMUP_SEED,
                )  # fmt: skip
            scripts = build_scripts(spec, seed)

            async def run(clock, on_done, concurrency=concurrency, scripts=scripts, seed=seed):
                records, _ = await run_multi_turn(
                    http, cfg, scripts, concurrency, clock, on_done,
                    tenants=settings.tenants, seed=seed, think_time_s=args.think_time,
                )  # fmt: skip
                return records

            num = spec.num_conversations * spec.num_turns
            records, server = await measured_run(http, settings, args, num, f"C={concurrency}", run)
            summary = results.summarize_run(
                records, mode="multi-turn", concurrency=concurrency, slo=settings.slo,
                server=server,
            )  # fmt: skip
            summary["num_turns_planned"] = num
            report["runs"].append(_add_parts(summary, records, "multi-turn"))
            per_run.append((summary, records))
    return report, per_run
