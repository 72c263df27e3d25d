"""`hipfire-loadgen`: refill / poisson / sweep load runs and the prefix-caching workloads
(shared-prefix, multi-turn) against an OpenAI-compatible server, and `compare` of reports.

  hipfire-loadgen refill --concurrency 1,2,4,8 --waves 4 --cohort code --max-tokens 128
  hipfire-loadgen poisson --rate 4 --num-requests 200 --burstiness 0.5 --slo ttft:500,tpot:50
  hipfire-loadgen sweep --rates 1,2,4,8 --num-requests 100
  hipfire-loadgen shared-prefix --num-groups 8 --system-prompt-len 2048 --concurrency 8
  hipfire-loadgen multi-turn --num-turns 6 --concurrency 4 --think-time 1
  hipfire-loadgen compare adaptive/refill.json ar/refill.json spec/refill.json

Every run writes LABEL.json (the full report), LABEL.csv (one row per run), LABEL-requests.csv
(one row per request) and LABEL-{throughput,latency,timeline}.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

import httpx

from loadtests import plots, prefix_workloads, results
from loadtests.compare import compare_table
from loadtests.prompts import COHORTS, load_cohort, load_prompts_file
from loadtests.run_setup import (
    client_config,
    http_client,
    measured_run,
    report_header,
    settings_from,
)
from loadtests.runners import plan_requests, run_poisson, run_refill
from loadtests.table import parts_table, runs_table


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return values


def _rate_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive rates like 1,2.5,inf, got {text!r}")
    return values


def _common(p: argparse.ArgumentParser, cohorts: bool = True, endpoint: bool = True) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="API root (…/v1)")
    g.add_argument("--model", default="", help="model name; default: the first of GET /models")
    if endpoint:
        g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--api-key", action="append", default=[], metavar="[NAME=]KEY",
                   help="repeat for several tenants; requests take the keys in turn")  # fmt: skip
    g.add_argument("--metrics-url", default="",
                   help="Prometheus endpoint scraped before/after each run; default: the "
                        "server root's /metrics; 'none' disables")  # fmt: skip
    g.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout (s)")
    g = p.add_argument_group("requests")
    if cohorts:
        src = g.add_mutually_exclusive_group()
        src.add_argument("--cohort", choices=COHORTS, default="mixed", help="shipped prompt cohort")
        src.add_argument(
            "--prompts", metavar="FILE", help="JSONL prompts (see loadtests/prompts.py)"
        )
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="prompt order and per-request seeds")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it)")  # fmt: skip
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--warmup", type=int, default=0, help="unmeasured requests before each run")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default="", help="goodput bounds, e.g. ttft:500,tpot:50 (ms)")
    g.add_argument("--out", default="loadgen-results", help="output directory")
    g.add_argument("--label", default="", help="run label; default: MODE-COHORT or the workload")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hipfire-loadgen",
        description="Load generator for OpenAI-compatible servers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("refill", help="closed loop: C slots refilled as requests finish")
    _common(p)
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8],
                   help="comma list, one run per value")  # fmt: skip
    p.add_argument("--waves", type=int, default=4, help="a run is WAVES * C requests")
    for name, help_ in (("poisson", "open loop at one rate"), ("sweep", "open loop over rates")):
        p = sub.add_parser(name, help=help_)
        _common(p)
        if name == "poisson":
            p.add_argument("--rate", type=_rate_list, default=[1.0], help="requests/s ('inf')")
        else:
            p.add_argument("--rates", dest="rate", type=_rate_list, required=True,
                           help="comma list of requests/s, one run per value")  # fmt: skip
        p.add_argument("--num-requests", type=int, default=100)
        p.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the gaps: 1 Poisson, <1 burstier")  # fmt: skip
        p.add_argument("--max-in-flight", type=int, default=0, help="cap (0: none)")
    _add_prefix_workloads(sub)
    p = sub.add_parser("compare", help="side-by-side ratios of report JSON files")
    p.add_argument("reports", nargs="+", metavar="REPORT.json")
    p.add_argument("--plot", default="", help="also write throughput vs concurrency PNG here")
    sub.add_parser("cohorts", help="list the shipped prompt cohorts")
    return parser


def _add_prefix_workloads(sub) -> None:
    p = sub.add_parser("shared-prefix", help="groups of requests sharing a long system prompt")
    _common(p, cohorts=False)
    g = p.add_argument_group("shared prefix (lengths in words, about tokens each)")
    g.add_argument("--num-groups", type=int, default=8, help="distinct system prompts")
    g.add_argument("--system-prompt-len", type=int, default=2048, help="words per system prompt")
    g.add_argument("--question-len", type=int, default=32, help="words of each request's own part")
    g.add_argument("--num-requests", type=int, default=64, help="requests per run")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=_int_list, default=[8],
                       help="closed loop: comma list, one run per value")  # fmt: skip
    shape.add_argument("--rate", type=_rate_list, default=None,
                       help="open loop instead: requests/s, comma list ('inf')")  # fmt: skip
    g.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape")
    g.add_argument("--max-in-flight", type=int, default=0, help="open loop: cap (0: none)")
    p = sub.add_parser("multi-turn", help="conversations resending their history (chat route)")
    _common(p, cohorts=False, endpoint=False)
    g = p.add_argument_group("conversations (lengths in words, about tokens each)")
    g.add_argument("--num-conversations", type=int, default=16, help="conversations per run")
    g.add_argument("--num-turns", type=int, default=4, help="user turns per conversation")
    g.add_argument("--concurrency", type=_int_list, default=[4],
                   help="conversations live at once: comma list, one run per value")  # fmt: skip
    g.add_argument("--system-prompt-len", type=int, default=512, help="0: no system message")
    g.add_argument("--num-system-prompts", type=int, default=0,
                   help="0: each conversation its own; K: K shared in turn")  # fmt: skip
    g.add_argument("--user-len", type=int, default=64, help="words per user message")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="mean pause (s, exponential) before each later turn")  # fmt: skip


async def run_load(args: argparse.Namespace) -> tuple[dict, list]:
    prompts = load_prompts_file(args.prompts) if args.prompts else load_cohort(args.cohort)
    settings = settings_from(args)
    for flag in ("waves", "num_requests"):
        if getattr(args, flag, 1) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    mode = "refill" if args.command == "refill" else "poisson"
    source = Path(args.prompts).stem if args.prompts else args.cohort
    report = report_header(args, settings, mode, f"{mode}-{source}")
    report.update(endpoint=args.endpoint, prompts=args.prompts or args.cohort,
                  num_prompts=len(prompts))  # fmt: skip
    tenants = settings.tenants
    per_run = []
    async with http_client(args) as http:
        cfg = await client_config(http, args, settings, args.endpoint)
        report["model"] = cfg.model
        values = args.concurrency if mode == "refill" else args.rate
        if mode == "refill":
            report["waves"] = args.waves
        else:
            report["num_requests"] = args.num_requests
            report["burstiness"] = args.burstiness
        for value in values:
            num = args.waves * value if mode == "refill" else args.num_requests
            requests = plan_requests(prompts, num, tenants, args.seed)
            if args.warmup:
                warm = plan_requests(prompts, args.warmup, tenants, args.seed + 10_000_019)
                warm_c = min(args.warmup, value if mode == "refill" else args.warmup)
                await run_refill(http, cfg, warm, warm_c, time.perf_counter, lambda r: None)

            async def run(clock, on_done, value=value, requests=requests):
                if mode == "refill":
                    return await run_refill(http, cfg, requests, value, clock, on_done)
                return await run_poisson(
                    http, cfg, requests, value, args.burstiness, args.seed, clock, on_done,
                    args.max_in_flight or None,
                )  # fmt: skip

            title = f"C={value}" if mode == "refill" else f"rate={value:g}"
            records, server = await measured_run(http, settings, args, num, title, run)
            run_summary = results.summarize_run(
                records, mode=mode,
                concurrency=value if mode == "refill" else None,
                rate=None if mode == "refill" or math.isinf(value) else value,
                slo=settings.slo, server=server,
            )  # fmt: skip
            report["runs"].append(run_summary)
            per_run.append((run_summary, records))
    return report, per_run


def write_outputs(report: dict, per_run: list, out_dir: Path, with_plots: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    label = report["label"]
    paths = [out_dir / f"{label}.json", out_dir / f"{label}.csv", out_dir / f"{label}-requests.csv"]
    results.write_json(report, paths[0])
    results.write_runs_csv(report, paths[1])
    results.write_requests_csv(per_run, paths[2])
    if with_plots:
        paths += plots.write_plots(report, out_dir)
    return paths


def _run(coro):
    """Runs the load on uvloop where available: its faster event loop keeps the client's own
    overhead (and so the skew of arrival timestamps) low at thousands of chunks per second."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "cohorts":
        for name in COHORTS:
            prompts = load_cohort(name)
            lens = sorted(len(p.prompt) for p in prompts)
            print(f"{name:<6} {len(prompts)} prompts, {lens[0]}..{lens[-1]} characters")
        return 0
    if args.command == "compare":
        reports = [results.load_report(p) for p in args.reports]
        print(compare_table(reports))
        if args.plot:
            plots.throughput_plot(reports, Path(args.plot))
            print(f"wrote {args.plot}")
        return 0
    runner = {
        "shared-prefix": prefix_workloads.run_shared_prefix,
        "multi-turn": prefix_workloads.run_multi_turn_load,
    }.get(args.command, run_load)
    try:
        report, per_run = _run(runner(args))
    except (ValueError, OSError, httpx.HTTPError, RuntimeError) as exc:
        print(f"hipfire-loadgen: {exc}", file=sys.stderr)
        return 2
    print(runs_table(report))
    if report.get("workload"):
        print(parts_table(report))
    for path in write_outputs(report, per_run, Path(args.out), args.plots):
        print(f"wrote {path}")
    num_errors = sum(run["num_errors"] for run in report["runs"])
    if num_errors:
        for run in report["runs"]:
            for msg in run["errors"]:
                print(f"error ({run['num_errors']} in run): {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
