"""`hipfire-serve simulate`: the scheduler simulator from the command line.

Runs every (policy, cohort, concurrency) of the grid against a cost profile and an acceptance
model, prints a table and writes the JSON (full-live tokens/s, refill tokens/s, mean accepted
length, rows per round, route mix, ... per point).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scheduler.sim.baselines import POLICY_NAMES
from scheduler.sim.grid import run_grid

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def _name_list(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hipfire-serve simulate",
        description="Run the real scheduler against a simulated executor driven by a cost "
        "profile and an acceptance model.",
    )
    p.add_argument(
        "--profile",
        default=str(PROFILES / "h200-qwen3-8b.json"),
        help="cost profile JSON (target rows_ms, drafter step costs, KV term)",
    )
    p.add_argument(
        "--acceptance",
        default=str(PROFILES / "acceptance.json"),
        help="acceptance model JSON (cohorts of two-state classes)",
    )
    p.add_argument(
        "--cohort",
        type=_name_list,
        default=["mixed"],
        help="cohort(s) of the acceptance file, comma-separated: code, prose, mixed",
    )
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 8, 64],
        help="slot capacities to simulate, comma-separated",
    )
    p.add_argument(
        "--policies",
        type=_name_list,
        default=["adaptive", "all-ar", "all-spec"],
        help=f"comma-separated, from: {', '.join(POLICY_NAMES)}",
    )
    p.add_argument(
        "--requests", type=int, default=0, help="requests per run; 0: max(16, 3 x concurrency)"
    )
    p.add_argument("--max-tokens", type=int, default=512, help="tokens generated per request")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="mean prompt length (uniform in [len/2, 3 len/2])",
    )
    p.add_argument("--spec-depth", type=int, default=8, help="rows per speculating request")
    p.add_argument(
        "--workload",
        choices=("refill", "poisson"),
        default="refill",
        help="refill: closed loop in waves; poisson: open-loop arrivals",
    )
    p.add_argument("--rate", type=float, default=0.0, help="poisson arrivals per second")
    p.add_argument(
        "--noise", type=float, default=0.03, help="log-normal sigma of measured round times"
    )
    p.add_argument(
        "--decide-ahead",
        action="store_true",
        help="decide each next round while the current one runs, as the engine's loop does",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="processes; 0: one per CPU")
    p.add_argument("--out", default="", help="write the results JSON here")
    return p


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'cohort':<7} {'C':>4} {'policy':<10} {'full-live tok/s':>15} {'refill tok/s':>12} "
        f"{'acc len':>7} {'rows':>7}  route mix (full-live)"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        full = r["full_live_tok_s"]
        acc = r["mean_accepted_len"]
        mix = r["route_mix_full_live"]
        lines.append(
            f"{r['cohort']:<7} {r['concurrency']:>4} {r['policy']:<10} "
            f"{(f'{full:.0f}' if full else '-'):>15} {r['refill_tok_s']:>12.0f} "
            f"{(f'{acc:.2f}' if acc else '-'):>7} {r['mean_rows']:>7.1f}  "
            f"S {mix.get('S', 0):.2f} A {mix.get('A', 0):.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [p for p in args.policies if p not in POLICY_NAMES]
    if unknown:
        print(
            f"unknown policies: {', '.join(unknown)} (known: {', '.join(POLICY_NAMES)})",
            file=sys.stderr,
        )
        return 2
    if args.workload == "poisson" and args.rate <= 0:
        print("--workload poisson needs --rate > 0", file=sys.stderr)
        return 2
    if args.spec_depth < 1 or args.max_tokens < 1 or args.prompt_len < 1:
        print("--spec-depth, --max-tokens and --prompt-len must be >= 1", file=sys.stderr)
        return 2
    try:
        rows = run_grid(
            args.profile,
            args.acceptance,
            args.cohort,
            args.concurrency,
            args.policies,
            num_requests=args.requests,
            max_tokens=args.max_tokens,
            prompt_len=args.prompt_len,
            spec_depth=args.spec_depth,
            seed=args.seed,
            workload=args.workload,
            arrival_rate=args.rate,
            noise_sigma=args.noise,
            num_workers=args.workers,
            decide_ahead=args.decide_ahead,
        )
    except (OSError, ValueError, KeyError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.out:
        payload = {
            "params": {k: v for k, v in vars(args).items() if k not in ("out", "workers")},
            "results": rows,
        }
        Path(args.out).write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
