"""Probe of SiLU-and-mul fused into the down projection (the skinny linear's gated input
prologue) on the decode forward: CUDA-graph replays of the random-weight Qwen3-8B-shaped target
and Qwen3-0.6B-shaped draft model with the fusion off and on, PDL on as served.

    python -m kernels.bench_fusion --out DIR [--models qwen3-8b,qwen3-0.6b] [--rows 1,4,16]

Per model and row count (one row per decoding sequence over `--context` tokens of random cached
KV) it captures two decode graphs in the same process, one under
`fused_prologue_forced(False)` and one under `fused_prologue_forced(True)`, both under
`pdl_forced(True)` (executor/graphs.py, the engine's own graphs), counts the fused launches
the second capture made (one per layer where the skinny kernel runs the down projection),
checks that both graphs give bit-identical logits and times their replays in alternating
rounds (kernels.bench_pdl's timing: CUDA events, the median of the rounds' means). It prints
a table and writes DIR/fusion.json and DIR/fusion.md with the GPU, the date and each time as
a ratio to the fusion-off graph. A harness over the executor's forward, so it imports
`executor` (lazily).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from kernels import bench_pdl

MODELS = bench_pdl.MODELS
ROWS = bench_pdl.ROWS
# DecodeGraphs.capture runs the forward twice outside the capture (Triton compiles) and once in
FORWARDS_PER_CAPTURE = 3


@contextlib.contextmanager
def fusion_as_served(fused: bool, counter: list[int] | None = None):
    """PDL on (where capable), the gated prologue on or off; `counter[0]` counts the fused
    launches made inside the block."""
    from kernels import skinny_linear as sl
    from kernels.arch import pdl_forced

    launch = sl.silu_mul_skinny_linear

    def counted(*args, **kwargs):
        counter[0] += 1
        return launch(*args, **kwargs)

    if counter is not None:
        sl.silu_mul_skinny_linear = counted
    try:
        with pdl_forced(True), sl.fused_prologue_forced(fused):
            yield
    finally:
        sl.silu_mul_skinny_linear = launch


def record_for(model_name: str, rows: int, times: dict, identical: bool, max_abs_diff: float,
               fused_launches: int) -> dict:  # fmt: skip
    """bench_pdl's record (off / on are fusion off / on here) and the fused launches of one
    forward's capture."""
    record = bench_pdl.record_for(model_name, rows, times, identical, max_abs_diff)
    return {**record, "fused_launches": fused_launches}


_HEADER = (
    "| model | rows | fusion off us | fusion on us | on / off | saved us | fused launches "
    "| identical |\n|---|---|---|---|---|---|---|---|"
)


def table_lines(records: list[dict]) -> list[str]:
    lines = [_HEADER]
    for r in records:
        lines.append(
            f"| {r['model']} | {r['rows']} | {r['off_us']:.1f} | {r['on_us']:.1f} | "
            f"{r['ratio']:.3f} | {r['saved_us']:.1f} | {r['fused_launches']} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    return lines


def write_report(out: Path, meta: dict, records: list[dict]) -> dict:
    """Writes out/fusion.json (meta + records) and out/fusion.md; returns the JSON record."""
    out.mkdir(parents=True, exist_ok=True)
    record = {**meta, "records": records}
    (out / "fusion.json").write_text(json.dumps(record, indent=1) + "\n")
    pdl = "PDL on" if meta["pdl_capable"] else "PDL unavailable here (GPU or Triton): both off"
    lines = [
        f"# SiLU-and-mul fused into the down projection, decode forward, {meta['device']}, "
        f"{meta['date']}",
        "",
        f"Random-weight models, bf16, {meta['context_len']} tokens of cached context per "
        "sequence, one row per sequence; CUDA-graph replays of the whole forward and LM head, "
        f"median of {meta['rounds']} rounds of {meta['replays']} replays, fusion-off and "
        f"fusion-on graphs alternating, {pdl} (torch {meta['torch']}, Triton "
        f"{meta['triton']}). Fused launches: down projections that took the gated prologue in "
        "one forward's capture.",
        "",
        *table_lines(records),
    ]
    (out / "fusion.md").write_text("\n".join(lines) + "\n")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--context", type=int, default=bench_pdl.CONTEXT_LEN)
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    args.models = tuple(args.models.split(","))
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    args.rows = tuple(int(r) for r in args.rows.split(","))
    if any(not 1 <= r <= 16 for r in args.rows):
        parser.error("rows must be 1..16 (the skinny linear's range)")
    if args.context < 1 or args.replays < 1 or args.rounds < 1:
        parser.error("--context, --replays and --rounds must be positive")
    return args


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    from executor.random_model import random_model

    model = random_model(
        name, device=device, dtype=torch.bfloat16, max_position=args.context + 64
    )
    num_blocks = max(args.rows) * bench_pdl.blocks_per_seq(args.context, 1)
    kv = bench_pdl.random_caches(model, num_blocks)
    records = []
    for rows in args.rows:
        batch = bench_pdl.decode_batch(
            rows, 1, args.context, model.config.vocab_size, device, seed=rows
        )
        counts = {False: [0], True: [0]}
        pair = bench_pdl.GraphPair(
            model, kv, batch, switch=lambda on, counts=counts: fusion_as_served(on, counts[on])
        )
        fused_launches = counts[True][0] // FORWARDS_PER_CAPTURE
        assert counts[False][0] == 0, "the fusion-off capture launched the fused kernel"
        off, on = pair.logits(False), pair.logits(True)
        times = bench_pdl.time_replays(
            {fused: pair.graph(fused) for fused in (False, True)}, args.replays, args.rounds
        )
        diff = float((off - on).abs().max())
        rec = record_for(name, rows, times, bool(torch.equal(off, on)), diff, fused_launches)
        print(table_lines([rec])[-1], flush=True)
        records.append(rec)
        del pair
    del model, kv
    torch.cuda.empty_cache()
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    from kernels.arch import pdl_capable
    from kernels.skinny_linear import FUSED_MAX_ROWS

    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    device = torch.device("cuda", torch.cuda.current_device())
    capable = pdl_capable(device)
    print(f"{torch.cuda.get_device_name(device)}: PDL {'on' if capable else 'unavailable'}")
    print(_HEADER)
    records = []
    for name in args.models:
        records += bench_model(name, args, device)
    meta = {
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl_capable": capable,
        "fused_max_rows": FUSED_MAX_ROWS,
        "context_len": args.context,
        "replays": args.replays,
        "rounds": args.rounds,
        "wall_s": round(time.time() - t0, 1),
    }
    write_report(args.out, meta, records)
    print(f"wall {meta['wall_s']} s; wrote {args.out / 'fusion.json'}")
    return 0 if all(r["identical"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
