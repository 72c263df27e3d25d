"""Deferred-drafts probe: speculating rounds through `Engine.step` with a draft model's drafts
taken on the device against the same rounds with the drafts waited for on the host first.

    python3 -m loadtests.defer_probe --out OUT

`RoundExecutor.launch` asks the drafter for a *deferred* proposal: the draft model returns once
its chain is enqueued, the round's batch is built on the host while the chain runs, and the
drafts are copied into the batch's rows on the device, so the target's forward follows the chain
without the host waiting in between. `waited` runs the same engine with every proposal resolved
before it returns (the host waits for the drafts, then builds the batch), which is how rounds
ran before. Both run in one process on one engine, alternating per concurrency and in the
opposite order on the second repeat, so drifts of the device hit both alike.

Per concurrency C: `--steps` full-depth speculating rounds of C greedy requests with `--context`
tokens of prompt (`executor.profiler._engine_steps`, every request drafting the engine's spec
depth), the median wall time of `Engine.step` and the median of the round's phases. Writes
`OUT/defer_probe.json` and prints the table (deferred over waited).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from loadtests.cli_args import int_tuple
from loadtests.probes import probe_engine, probe_parser, write_report
from loadtests.table import render

MODES = ("deferred", "waited")


def _force_waited(drafter, mode: dict):
    """Wraps `drafter.propose` so that it resolves every proposal while mode["waited"]."""
    propose = drafter.propose

    def maybe_waited(requests, greedy, defer=False):
        return propose(requests, greedy, defer and not mode["waited"])

    drafter.propose = maybe_waited


def probe(engine, concurrencies, context: int, steps: int, repeats: int) -> list[dict]:
    from executor.profiler import _engine_steps

    mode = {"waited": False}
    _force_waited(engine.executor.drafter, mode)
    runs = []
    for rep in range(repeats):
        for c in concurrencies:
            for name in MODES if rep % 2 == 0 else MODES[::-1]:
                mode["waited"] = name == "waited"
                c_run, done = _engine_steps(engine, c, context, steps, "spec")
                if not done:
                    continue
                phases = {
                    k: round(statistics.median(st.phase_s.get(k, 0.0) * 1e3 for _, st in done), 4)
                    for k in done[0][1].phase_s
                }
                runs.append(
                    {
                        "repeat": rep,
                        "concurrency": c_run,
                        "mode": name,
                        "steps": len(done),
                        "step_ms": round(statistics.median(w for w, _ in done), 4),
                        "round_ms": round(
                            statistics.median(st.measured_s * 1e3 for _, st in done), 4
                        ),
                        "phase_ms": phases,
                    }
                )
    return runs


def summary(runs: list[dict]) -> list[dict]:
    """Per concurrency: the mean over repeats of each mode's median step, and their ratio."""
    out = []
    for c in sorted({r["concurrency"] for r in runs}):
        ms = {
            m: [r["step_ms"] for r in runs if r["concurrency"] == c and r["mode"] == m]
            for m in MODES
        }
        if not all(ms.values()):
            continue
        deferred, waited = statistics.mean(ms["deferred"]), statistics.mean(ms["waited"])
        out.append(
            {
                "concurrency": c,
                "deferred_step_ms": round(deferred, 3),
                "waited_step_ms": round(waited, 3),
                "ratio": round(deferred / waited, 4),
                "repeats": len(ms["deferred"]),
            }
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = probe_parser("defer_probe", __doc__, "defer_probe.json")
    ap.add_argument("--concurrency", default="1,4,16,64", help="speculating requests per round")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--spec-depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="measured rounds per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="40GiB")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        concurrencies = int_tuple(args.concurrency)
    except ValueError as e:
        print(f"defer_probe: bad --concurrency: {e}", file=sys.stderr)
        return 2
    if not concurrencies or min(concurrencies) < 1 or args.context < 2:
        print("defer_probe: need --concurrency >= 1 and --context >= 2", file=sys.stderr)
        return 2
    if args.steps < 1 or args.repeats < 1 or args.spec_depth < 2:
        print("defer_probe: need --steps >= 1, --repeats >= 1, --spec-depth >= 2", file=sys.stderr)
        return 2
    tokens = (args.steps + 16) * args.spec_depth  # what _engine_steps lets a request emit
    engine = probe_engine(
        args, max(concurrencies), args.spec_depth, args.context + tokens + args.spec_depth + 16
    )
    if not hasattr(engine.executor.drafter, "model"):
        print("defer_probe: --draft must name a draft model", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    runs = probe(engine, concurrencies, args.context, args.steps, args.repeats)
    fields = {
        "model": args.model,
        "draft": args.draft,
        "context": args.context,
        "spec_depth": args.spec_depth,
        "summary": summary(runs),
        "runs": runs,
    }
    report = write_report(args.out, "defer_probe.json", engine.target.device, fields, t0)
    rows = [
        [
            str(s["concurrency"]),
            f"{s['deferred_step_ms']:.3f}",
            f"{s['waited_step_ms']:.3f}",
            f"{s['ratio']:.4f}",
        ]
        for s in report["summary"]
    ]
    print(render(["C", "deferred ms/step", "waited ms/step", "deferred / waited"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
