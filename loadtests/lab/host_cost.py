"""Host cost per output token on a CPU: the engine driven in-process and, optionally, the HTTP
server, at a few concurrencies, with each round's phases.

    hipfire-bench host-cost --out docs/perf                     # demo model, C=1 and C=4
    hipfire-bench host-cost --spec-modes adaptive,ar,spec --http --repeats 5
    hipfire-bench host-cost --profile 40                        # + cProfile's top functions
    hipfire-bench host-cost --out docs/perf --baseline old/cpu-host-cost.json  # + ratios

Uses project internals (the engine and its round records; `hipfire-serve serve` for `--http`).
Writes `cpu-host-cost.md` and `cpu-host-cost.json` under `--out` (or `--name`'s); with
`--baseline` (a record this command wrote, e.g. at an earlier commit) the markdown also gives
each point's ms per token as a ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loadtests.lab.cli_args import int_tuple

METHOD = """\
In-process: one `Engine` per spec mode with the serving defaults (`scripts/serve`'s: the demo
target and its block drafter, CPU, float32) but the mode. A run starts C greedy requests of
`--max-tokens` tokens (EOS ignored) together and steps until they finish; `--repeats` runs per
point after one unmeasured run. ms per output token: per request, (last token - first token) /
(tokens - 1), as `vllm bench serve` reports TPOT; the median over requests and runs. The phase
breakdown is the engine's own round records (`RoundStats.phase_s`: plan, build, draft, forward,
accept, commit, update, collect), summed over the runs and divided by output tokens; `other` is
the wall time of `Engine.step` calls that no phase covers (outputs, stats, bookkeeping).
HTTP (`--http`): `hipfire-serve serve` in a child process with the same flags, fed by C
streaming `/v1/completions` clients on keep-alive connections in this process; TPOT from the
arrival times of the first and last SSE chunks and the usage's completion tokens."""

PROMPTS = (
    "def add(a, b):\n    return",
    "The quick brown fox",
    "for i in range(10):\n    print(i",
    "class Slot:\n    def __init__(self, req_id):",
)
PHASES = ("plan", "build", "draft", "forward", "accept", "commit", "update", "collect")
STARTUP_RE = re.compile(r"at http://127\.0\.0\.1:(\d+)/v1")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- in-process -------------------------------------------------------------------------------


def engine_flags(mode: str, extra: list[str]) -> list[str]:
    return ["--spec-mode", mode, "--device", "cpu", *extra]


def run_engine_point(engine, concurrency: int, max_tokens: int, run_id: str) -> dict:
    """One run of C requests started together; -> per-request TPOT, tokens, phase sums."""
    from hipfire_serve.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.stats()  # drop older round records
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    for i in range(concurrency):
        rid = f"{run_id}-{i}"
        engine.add_request(rid, PROMPTS[i % len(PROMPTS)], params)
        counts[rid], tokens[rid] = 0, []
    step_s, num_steps = 0.0, 0
    t_start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_s += now - t0
        num_steps += 1
        for out in outputs:
            n = sum(len(c.token_ids) for c in out.outputs)
            if n:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] += n
                tokens[out.request_id] += out.outputs[0].token_ids
    wall_s = time.perf_counter() - t_start
    rounds = engine.stats().rounds
    phases = {p: sum(r.phase_s.get(p, 0.0) for r in rounds) for p in PHASES}
    return {
        "tpot_ms": [1e3 * (last[r] - first[r]) / max(counts[r] - 1, 1) for r in counts],
        "output_tokens": sum(counts.values()),
        "wall_s": wall_s,
        "step_s": step_s,
        "num_steps": num_steps,
        "num_rounds": len(rounds),
        "routes": "".join(r.route for r in rounds),
        "phase_s": phases,
        "tokens": [tokens[f"{run_id}-{i}"] for i in range(concurrency)],
    }


def summarize_engine(runs: list[dict]) -> dict:
    tokens = sum(r["output_tokens"] for r in runs)
    phase_ms = {p: 1e3 * sum(r["phase_s"][p] for r in runs) / tokens for p in PHASES}
    step_ms = 1e3 * sum(r["step_s"] for r in runs) / tokens
    phase_ms["other"] = step_ms - sum(phase_ms.values())
    routes = "".join(r["routes"] for r in runs)
    decode = sum(routes.count(c) for c in "AS")
    return {
        "tpot_ms_median": _median([t for r in runs for t in r["tpot_ms"]]),
        "tpot_ms_runs": [_median(r["tpot_ms"]) for r in runs],
        "wall_ms_per_token": 1e3 * sum(r["wall_s"] for r in runs) / tokens,
        "step_ms_per_token": step_ms,
        "rounds_per_token": sum(r["num_rounds"] for r in runs) / tokens,
        "spec_share": routes.count("S") / decode if decode else 0.0,
        "phase_ms_per_token": phase_ms,
        "tokens_first_run": runs[0]["tokens"],
    }


def engine_side(args, mode: str) -> tuple[dict, str | None]:
    """Every concurrency of one spec mode in this process (one engine); -> (points, profile)."""
    import torch

    from hipfire_serve.engine import Engine
    from hipfire_serve.server.config import resolve

    engine = Engine(resolve(engine_flags(mode, args.engine_args), environ={})[0])
    points: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    profile_text = None
    for c in args.concurrency:
        run_engine_point(engine, c, args.max_tokens, f"warm{c}")
        runs = [
            run_engine_point(engine, c, args.max_tokens, f"c{c}r{i}") for i in range(args.repeats)
        ]
        points[f"C={c}"] = summarize_engine(runs)
        s = points[f"C={c}"]
        print(f"[engine {mode} C={c}] {s['tpot_ms_median']:.2f} ms/token (runs "
              f"{', '.join(f'{t:.2f}' for t in s['tpot_ms_runs'])}) spec share "
              f"{s['spec_share']:.2f}", flush=True)  # fmt: skip
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_engine_point(engine, 1, args.max_tokens, "profile")
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile)
        profile_text = buf.getvalue()
    return points, profile_text


# --- HTTP -------------------------------------------------------------------------------------


async def _stream_one(host: str, port: int, body: bytes) -> tuple[float, float, int]:
    """One streaming request on its own connection -> (first chunk, last chunk, tokens)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + body)
    first = last = 0.0
    buf = b""
    usage = 0
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            now = time.perf_counter()
            buf += data
            if b'"text"' in data and b'"completion_tokens"' not in data:
                first = first or now
                last = now
            if buf.endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in buf:
                break
    finally:
        writer.close()
    match = re.findall(rb'"completion_tokens":\s*(\d+)', buf)
    if match:
        usage = int(match[-1])
    return first, last, usage


async def _http_point(url: str, concurrency: int, max_tokens: int) -> list[float]:
    host, port = url.removeprefix("http://").split(":")
    bodies = [
        json.dumps({
            "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }).encode()
        for i in range(concurrency)
    ]  # fmt: skip
    results = await asyncio.gather(*(_stream_one(host, int(port), b) for b in bodies))
    return [1e3 * (last - first) / max(n - 1, 1) for first, last, n in results]


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads by role: `loop` (the main thread: the event
    loop), `engine` (the engine thread) and `other` (torch's intra-op pool and the rest)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": 0.0, "engine": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        role = (
            "loop" if int(tid) == pid else "engine" if name.startswith("hipfire-eng") else "other"
        )
        out[role] += (int(fields[11]) + int(fields[12])) / tick
    return out


def http_side(args, mode: str) -> dict:
    flags = engine_flags(mode, args.engine_args)
    cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", *flags,
           "--port", "0", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = None
    try:
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before start-up")
            match = STARTUP_RE.search(line)
            if match:
                url = f"http://127.0.0.1:{match.group(1)}"
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        points = {}
        for c in args.concurrency:
            asyncio.run(_http_point(url, c, args.max_tokens))  # warm-up
            cpu0 = thread_cpu_s(proc.pid)
            runs = [asyncio.run(_http_point(url, c, args.max_tokens)) for _ in range(args.repeats)]
            cpu1 = thread_cpu_s(proc.pid)
            tokens = args.repeats * c * args.max_tokens
            points[f"C={c}"] = {
                "tpot_ms_median": _median([t for r in runs for t in r]),
                "tpot_ms_runs": [_median(r) for r in runs],
                # server CPU per output token by thread role (clock ticks: coarse)
                "cpu_ms_per_token": {k: 1e3 * (cpu1[k] - cpu0[k]) / tokens for k in cpu0},
            }
            s = points[f"C={c}"]
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_ms_per_token"].items())
            print(f"[http {mode} C={c}] {s['tpot_ms_median']:.2f} ms/token (runs "
                  f"{', '.join(f'{t:.2f}' for t in s['tpot_ms_runs'])}); server CPU ms/token: "
                  f"{cpu}", flush=True)  # fmt: skip
        return points
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# --- report -----------------------------------------------------------------------------------


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version()}


def table(record: dict) -> str:
    lines = [
        "| mode | C | engine ms/token | HTTP ms/token | rounds/token | spec share | "
        + " | ".join((*PHASES, "other"))
        + " |",
        "|---" * (6 + len(PHASES) + 1) + "|",
    ]
    for mode, sides in record["modes"].items():
        for key, e in sides["engine"].items():
            if not key.startswith("C="):
                continue
            h = sides.get("http", {}).get(key)
            http = f"{h['tpot_ms_median']:.2f}" if h else "-"
            ph = " | ".join(f"{e['phase_ms_per_token'][p]:.3f}" for p in (*PHASES, "other"))
            lines.append(
                f"| `{mode}` | {key[2:]} | {e['tpot_ms_median']:.2f} | {http} | "
                f"{e['rounds_per_token']:.3f} | {e['spec_share']:.2f} | {ph} |"
            )
    return "\n".join(lines)


def points(record: dict) -> dict[str, dict]:
    """'mode C=n' -> {'engine': ms per token, 'http': ms per token or None} of one record."""
    out = {}
    for mode, sides in record["modes"].items():
        for key, e in sides["engine"].items():
            if key.startswith("C="):
                h = sides.get("http", {}).get(key)
                out[f"{mode} {key}"] = {
                    "engine": e["tpot_ms_median"],
                    "http": h["tpot_ms_median"] if h else None,
                }
    return out


def comparison_table(now: dict[str, dict], baseline: dict[str, dict]) -> str:
    """Median ms per output token, baseline against now, for the points both measured."""
    lines = [
        "| point | engine, baseline | engine, now | now / baseline "
        "| HTTP, baseline | HTTP, now | now / baseline |",
        "|---|---|---|---|---|---|---|",
    ]

    def cells(b: float | None, n: float | None) -> str:
        if b is None or n is None:
            return "- | - | -"
        return f"{b:.2f} | {n:.2f} | {n / b:.2f}x"

    for key in (k for k in now if k in baseline):
        b, n = baseline[key], now[key]
        lines.append(
            f"| {key} | {cells(b['engine'], n['engine'])} | {cells(b['http'], n['http'])} |"
        )
    return "\n".join(lines)


def markdown(record: dict, baseline: dict | None) -> str:
    m = record["machine"]
    parts = [
        "# Host cost per output token on a CPU",
        "",
        f"`hipfire-bench host-cost`, {m['cpu'] or 'CPU'} ({m['nproc']} cores), Python "
        f"{m['python']}, {record['date']}. Settings: `{json.dumps(record['settings'])}`.",
        "",
        METHOD,
        "",
        "## Per point (ms per output token; phases in ms per output token)",
        "",
        table(record),
    ]
    if baseline is not None:
        parts += [
            "",
            f"## Against the baseline ({baseline.get('date', '?')})",
            "",
            comparison_table(points(record), points(baseline)),
        ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hipfire-bench host-cost",
        description=__doc__.split("\n\n")[0],
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--spec-modes", default="adaptive", help="comma-separated")
    parser.add_argument("--concurrency", type=int_tuple, default=(1, 4), help="e.g. 1,4")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--http", action="store_true", help="also through the HTTP server")
    parser.add_argument("--profile", type=int, default=0, help="cProfile's top N at C=1")
    parser.add_argument(
        "--engine-arg", dest="engine_args", action="append", default=[],
        help="an extra `hipfire-serve serve` flag for both sides (repeat it)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--name", default="cpu-host-cost")
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier record (JSON)")
    args = parser.parse_args(argv)
    baseline = None
    if args.baseline is not None:
        try:
            baseline = json.loads(args.baseline.read_text())
            points(baseline)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            parser.error(f"--baseline {args.baseline}: not a host-cost record ({e})")
    record: dict[str, Any] = {
        "benchmark": "host_cost",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "settings": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in vars(args).items()
            if k not in ("out", "baseline")
        },
        "modes": {},
    }
    profiles = {}
    for mode in args.spec_modes.split(","):
        engine, profiles[mode] = engine_side(args, mode)
        record["modes"][mode] = {"engine": engine}
        if args.http:
            record["modes"][mode]["http"] = http_side(args, mode)
    print(table(record))
    for mode, text in profiles.items():
        if text:
            print(f"--- cProfile, {mode}, C=1\n{text}")
            record["modes"][mode]["profile_top"] = text
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / f"{args.name}.md").write_text(markdown(record, baseline))
    if baseline is not None:
        print(comparison_table(points(record), points(baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
