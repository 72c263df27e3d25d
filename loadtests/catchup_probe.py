"""Probe of the draft model's catch-up (a whole prompt's rows in one wide forward, what a
request's first speculating round pays when the drafter did not follow its prefill): wall time
of `propose` by row count for one prompt and for several prompts at once, with programmatic
dependent launch on and off, then one call under the torch profiler, whose totals split it into
host time and device time.

    python -m loadtests.catchup_probe [--model qwen3-0.6b] [--rows 256,1024,4096,16384]

With `--ragged "1100;1100,1000;..."` it instead times catch-ups of uneven prompts (each `;`
group one proposal, its prompts caught up together) against the prices the cost model gives
them from the profile's catch-up points: at the rows as they are, and by the passes the drafter
runs (`scheduler.cost_model.wide_catchup_ms`). `--out FILE` writes those rows as JSON.

Needs a CUDA GPU; a harness over the executor's drafter and profiler (imports them lazily).
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="random-weight preset")
    ap.add_argument("--rows", default="256,1024,4096,16384", help="catch-up rows")
    ap.add_argument("--prompt-rows", type=int, default=1024, help="rows of one prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ragged", default="", help="prompt lengths: 1100;1100,1000;...")
    ap.add_argument("--out", default="", help="JSON of the --ragged rows")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("catchup_probe: needs a CUDA GPU")
        return 1
    from executor.drafters.base import DraftRequest
    from executor.ops import pdl_forced
    from executor.profiler import standalone_drafter, time_draft_catchup
    from executor.random_model import random_model

    rows = tuple(int(r) for r in args.rows.split(","))
    model = random_model(
        args.model, device=torch.device("cuda"), dtype=torch.bfloat16, max_position=4096
    )
    if args.ragged:
        groups = [[int(n) for n in g.split(",")] for g in args.ragged.split(";")]
        return ragged(model, groups, args.repeats, args.out)
    print(f"{torch.cuda.get_device_name()}, {args.model}: propose() wall ms by catch-up rows")
    for pdl in (True, False):
        with pdl_forced(pdl):
            single = tuple(r for r in rows if r <= args.prompt_rows)
            one = time_draft_catchup(model, single, args.repeats)
            many = time_draft_catchup(model, rows, args.repeats, rows_per_req=args.prompt_rows)
        print(f"  PDL {'on ' if pdl else 'off'} one prompt:  {one}")
        print(f"  PDL {'on ' if pdl else 'off'} prompts of {args.prompt_rows}: {many}")
    n = rows[0]
    drafter = standalone_drafter(model, 1, max(n, 2), 2, True)
    context = torch.randint(0, model.config.vocab_size, (n,)).tolist()
    request = DraftRequest(0, context, 1)
    for i in range(3):  # (the first call warms up)
        drafter.setup(0, context)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        drafter.propose([request], [True])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(
            f"  {n} rows, call {i}: host returns after {1e3 * (t1 - t0):.2f} ms, "
            f"device done after {1e3 * (t2 - t0):.2f} ms"
        )
    from torch.profiler import ProfilerActivity, profile

    drafter.setup(0, context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        drafter.propose([request], [True])
        torch.cuda.synchronize()
    events = prof.key_averages()
    host_ms = sum(e.self_cpu_time_total for e in events) / 1e3
    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    print(f"  {n} rows under the profiler: host {host_ms:.2f} ms, device {device_ms:.2f} ms")
    return 0


def ragged(model, groups: list[list[int]], repeats: int, out: str) -> int:
    """Catch-ups of uneven prompts, measured against the profile's prices of them."""
    import json
    import statistics

    import numpy as np
    import torch

    from executor.drafters.base import DraftRequest
    from executor.profiler import (
        CATCHUP_PROMPT_ROWS,
        catchup_profile_rows,
        standalone_drafter,
        time_draft_catchup,
    )
    from scheduler.cost_model import interp_linear_tail, wide_catchup_ms, wide_pass_padded_rows

    points = time_draft_catchup(
        model, catchup_profile_rows(4096), repeats, rows_per_req=CATCHUP_PROMPT_ROWS
    )
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    drafter = standalone_drafter(model, max(map(len, groups)), max(max(g) for g in groups), 2)
    buckets = np.asarray(drafter.wide_buckets)

    def curve(rows):
        return interp_linear_tail(np.asarray(rows), xs, ys)

    g = torch.Generator().manual_seed(2)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}: catch-up points {points}")
    print("prompts | rows | padded | measured ms | priced as is | priced by passes")
    for lens in groups:
        reqs = [
            DraftRequest(
                s, torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(), 1
            )
            for s, n in enumerate(lens)
        ]
        times = []
        for i in range(repeats + 1):
            for r in reqs:
                drafter.setup(r.slot, r.context)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            drafter.propose(reqs, [True] * len(reqs))
            torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        rows = sum(lens)
        padded = int(wide_pass_padded_rows(np.array([rows]), drafter.wide_pass_rows, buckets)[0])
        row = {
            "prompts": lens,
            "rows": rows,
            "padded_rows": padded,
            "measured_ms": round(statistics.median(times), 4),
            "priced_ms": round(float(curve([rows])[0]), 4),
            "priced_passes_ms": round(
                float(wide_catchup_ms(curve, np.array([rows]), drafter.wide_pass_rows, buckets)[0]),
                4,
            ),
        }
        rows_out.append(row)
        print(" | ".join(str(v) for v in row.values()))
    if out:
        with open(out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "points": points, "rows": rows_out}, f
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
