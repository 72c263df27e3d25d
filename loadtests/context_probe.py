"""Context probe: what ragged contexts cost against uniform ones, for draft-model proposals and
target rounds.

    python3 -m loadtests.context_probe --out OUT

The cost profile measures proposals and verify rounds with every sequence at one reference
context, and the cost model prices other contexts by their total KV tokens (the batch's mean).
A serving batch is ragged: this probe times, at each request count, the same shape three ways:

- `uniform`: every sequence at `--context` tokens;
- `ragged`: lengths drawn uniformly from [context / 2, 3 context / 2] (the benchmark's prompts);
- `uniform-max`: every sequence at the ragged batch's longest length;

for `DraftModelDrafter.propose` (`--draft-counts` requests, `--drafts` drafts each, after a
verified round: `executor.profiler.time_draft_proposals`) and for whole target rounds
(`RoundTimer.time_round`, `--rounds` as k x rows per sequence). `mean_based_ms` interpolates
the two uniform timings at the ragged batch's mean length: where `ragged` sits above it, the
longest sequences set the pace (attention splits are per sequence).

Writes `OUT/context_probe.json` and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from loadtests.cli_args import int_tuple
from loadtests.probes import probe_engine, probe_parser, write_report


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    """ "16x8,64x1" -> ((16, 8), (64, 1))."""
    out = []
    for item in text.split(","):
        if item.strip():
            k, r = item.lower().split("x")
            out.append((int(k), int(r)))
    return tuple(out)


def ragged_lengths(count: int, context: int, rng: np.random.Generator) -> list[int]:
    """`count` lengths uniform in [context / 2, 3 context / 2]."""
    return rng.integers(max(context // 2, 1), context * 3 // 2 + 1, count).tolist()


def mean_based(uniform_ms: float, max_ms: float, context: int, top: int, mean: float) -> float:
    """The two uniform timings interpolated at `mean` (what a price by total KV tokens says)."""
    if top == context:
        return uniform_ms
    return uniform_ms + (max_ms - uniform_ms) * (mean - context) / (top - context)


def probe_three(kind: str, shape: str, k: int, context: int, rng, time_ms) -> dict:
    """Times `time_ms(lengths)` (ms) for `k` sequences uniform at `context`, ragged around it and
    uniform at the ragged batch's longest length. -> one row of the report"""
    lens = ragged_lengths(k, context, rng)
    top, mean = max(lens), float(np.mean(lens))
    uniform = time_ms([context] * k)
    ragged = time_ms(lens)
    at_max = time_ms([top] * k)
    return {
        "kind": kind,
        "shape": shape,
        "ragged_mean": round(mean, 1),
        "ragged_max": top,
        "uniform_ms": round(uniform, 4),
        "ragged_ms": round(ragged, 4),
        "uniform_max_ms": round(at_max, 4),
        "mean_based_ms": round(mean_based(uniform, at_max, context, top, mean), 4),
    }


def probe_proposals(model, counts, drafts, context, repeats, rng) -> list[dict]:
    from executor.profiler import draft_bench, time_draft_proposals

    drafter, contexts = draft_bench(model, max(counts), context * 3 // 2, drafts)

    def propose_ms(k: int, lengths: list[int]) -> float:
        # (each slot's drafter KV covers the longest context: shorter ones are prefixes)
        ctx = [c[:n] for c, n in zip(contexts, lengths)] + contexts[k:]
        out = time_draft_proposals(
            model, (k,), (drafts,), repeats, context_len=context, bench=(drafter, ctx)
        )
        return out[0][2]

    return [
        probe_three(
            "propose",
            f"{k} x {drafts} drafts",
            k,
            context,
            rng,
            lambda lens, k=k: propose_ms(k, lens),
        )
        for k in counts
    ]


def probe_rounds(engine, shapes, context, repeats, rng) -> list[dict]:
    from executor.profiler import RoundTimer

    timer = RoundTimer(engine.executor, engine.config.spec_depth)

    def forward_ms(k: int, per_seq: int, lengths: list[int]) -> float:
        timer.time_round(k * per_seq, context, repeats, rows_per_seq=per_seq, kv_lens=lengths)
        return timer.last_phases["forward"]

    return [
        probe_three(
            "round forward",
            f"{k} x {r} rows",
            k,
            context,
            rng,
            lambda lens, k=k, r=r: forward_ms(k, r, lens),
        )
        for k, r in shapes
    ]


def build_parser() -> argparse.ArgumentParser:
    ap = probe_parser("context_probe", __doc__, "context_probe.json")
    ap.add_argument("--context", type=int, default=1024, help="mean context per sequence")
    ap.add_argument("--draft-counts", default="8,16,32,64", help="requests per proposal")
    ap.add_argument("--drafts", type=int, default=7, help="drafts per request")
    ap.add_argument("--rounds", default="16x8,32x8,64x1", help="target rounds: k x rows per seq")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="40GiB")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts, shapes = int_tuple(args.draft_counts), _pairs(args.rounds)
    except ValueError as e:
        print(f"context_probe: bad --draft-counts or --rounds: {e}", file=sys.stderr)
        return 2
    if args.context < 2 or args.drafts < 1 or args.repeats < 1 or not (counts or shapes):
        print("context_probe: need --context >= 2, --drafts >= 1, --repeats >= 1", file=sys.stderr)
        return 2
    depth = max(max((r for _, r in shapes), default=1), args.drafts + 1)
    engine = probe_engine(
        args,
        max((k for k, _ in shapes), default=1),
        depth,
        args.context * 3 // 2 + depth + 16,
    )
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    model = getattr(engine.drafter, "model", None)
    rows = []
    if counts and model is not None:
        rows += probe_proposals(model, counts, args.drafts, args.context, args.repeats, rng)
    if shapes:
        rows += probe_rounds(engine, shapes, args.context, args.repeats, rng)
    fields = {
        "model": args.model,
        "draft": args.draft,
        "context": args.context,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_report(args.out, "context_probe.json", engine.target.device, fields, t0)
    print(
        f"{'kind':<14} {'shape':<16} {'mean':>6} {'max':>5} {'uniform':>8} {'ragged':>8} "
        f"{'at max':>8} {'mean-based':>10}"
    )
    for r in rows:
        print(
            f"{r['kind']:<14} {r['shape']:<16} {r['ragged_mean']:>6.0f} {r['ragged_max']:>5} "
            f"{r['uniform_ms']:>8.3f} {r['ragged_ms']:>8.3f} {r['uniform_max_ms']:>8.3f} "
            f"{r['mean_based_ms']:>10.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
