"""TTFT with prefix caching on vs off: this server twice, the same workloads from the loadgen.

    hipfire-bench prefix-cache --out docs/perf     # the embedded demo model on CPU

Uses the `hipfire-serve serve` command line (one server with `--enable-prefix-caching`, one with
`--no-enable-prefix-caching`, otherwise alike) and `hipfire-loadgen shared-prefix` /
`multi-turn` against each; writes `prefix-cache.md` and `prefix-cache.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from loadtests.cli import main as loadgen_main

METHOD = """\
Both servers are started at once and warmed up with a small shared-prefix run. Then, for each
of `--repetitions`, each workload runs on one server and then the other (which goes first
alternates), so both see the same changes in the machine's load. Every repetition draws new
texts (its own seed), so a repetition's first requests find nothing cached on either server.
Per side the figures are medians over the repetitions; the ratios are off / on (above 1: the
cache makes it faster).
"""

STARTUP_RE = re.compile(r"at http://127\.0\.0\.1:(\d+)/v1")
SIDES = ("on", "off")
WORKLOADS = ("shared-prefix", "multi-turn")


class Server:
    """`hipfire-serve serve` in a child process on a free port."""

    def __init__(self, args: argparse.Namespace, caching: bool) -> None:
        flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
        cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", "--model", args.model,
               "--draft", args.draft, "--spec-mode", args.spec_mode, "--device", "cpu",
               "--dtype", "float32", "--graphs", "off", "--kv-cache-memory", args.kv_cache_memory,
               "--max-concurrency", str(args.max_concurrency), "--port", "0",
               "--log-level", "warning", flag]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.torch_threads)}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.url = ""

    def wait_ready(self) -> str:
        while not self.url:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before start-up")
            match = STARTUP_RE.search(line)
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}/v1"
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        return self.url

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def loadgen_args(args: argparse.Namespace, workload: str, seed: int) -> list[str]:
    if workload == "shared-prefix":
        return ["shared-prefix", "--num-groups", str(args.num_groups),
                "--system-prompt-len", str(args.system_prompt_len),
                "--question-len", str(args.question_len), "--num-requests", str(args.num_requests),
                "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
                "--seed", str(seed)]  # fmt: skip
    return ["multi-turn", "--num-conversations", str(args.num_conversations),
            "--num-turns", str(args.num_turns), "--system-prompt-len", str(args.mt_system_len),
            "--user-len", str(args.user_len), "--concurrency", str(args.concurrency),
            "--max-tokens", str(args.max_tokens), "--seed", str(seed)]  # fmt: skip


def run_loadgen(url: str, argv: list[str], out: Path, label: str) -> dict:
    rc = loadgen_main([*argv, "--base-url", url, "--out", str(out), "--label", label,
                       "--no-plots", "--no-progress"])  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"hipfire-loadgen {' '.join(argv)} exited with {rc}")
    return json.loads((out / f"{label}.json").read_text())["runs"][0]


def figures(run: dict) -> dict:
    """The figures compared, from one loadgen run (latencies in ms)."""
    out = {f"ttft_{q}_ms": run["ttft"][f"{q}_ms"] for q in ("p50", "p90", "p99")}
    for part, p in run["ttft_split"].items():
        for q in ("p50", "p90"):
            out[f"ttft_{part}_{q}_ms"] = p["ttft"][f"{q}_ms"]
    for turn, p in (run.get("turns") or {}).items():
        out[f"ttft_turn{turn}_p50_ms"] = p["ttft"]["p50_ms"]
        out[f"prompt_tokens_turn{turn}"] = p["mean_prompt_tokens"]
    out["output_tokens_per_s"] = run["refill_tokens_per_s"]
    out["requests_per_s"] = run["requests_per_s"]
    out["mean_prompt_tokens"] = run["num_prompt_tokens"] / max(run["num_ok"], 1)
    server = run.get("server") or {}
    out["prefix_cache_counters"] = bool(server.get("prefix_cache_counters"))
    out["prefix_cache_hit_rate"] = server.get("prefix_cache_hit_rate")
    return out


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(reps: list[dict]) -> dict:
    """Per workload: each side's medians over the repetitions, TTFT off / on and throughput
    on / off (both above 1 where the cache helps)."""
    out = {}
    for workload in WORKLOADS:
        sides = {}
        for side in SIDES:
            runs = [rep[workload][side] for rep in reps]
            keys = [k for k in runs[0] if k != "prefix_cache_counters"]
            sides[side] = {k: _median([r.get(k) for r in runs]) for k in keys}
            sides[side]["prefix_cache_counters"] = all(r["prefix_cache_counters"] for r in runs)
        on, off = sides["on"], sides["off"]
        out[workload] = {
            **sides,
            "ttft_off_over_on": {
                k: off[k] / v
                for k, v in on.items()
                if k.startswith("ttft") and v and off.get(k) is not None
            },
            "throughput_on_over_off": {
                k: on[k] / off[k] for k in ("output_tokens_per_s", "requests_per_s") if off[k]
            },
        }
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def _hit(side: dict) -> str:
    if not side["prefix_cache_counters"]:
        return "absent"
    return _fmt(side["prefix_cache_hit_rate"], 3)


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _table_rows(workload: str, w: dict, num_turns: int) -> list[str]:
    parts = [("all", "ttft_p50_ms"), ("all p90", "ttft_p90_ms"), ("first", "ttft_first_p50_ms"),
             ("later", "ttft_later_p50_ms"), ("later p90", "ttft_later_p90_ms")]  # fmt: skip
    if workload == "multi-turn":
        parts += [(f"turn {t}", f"ttft_turn{t}_p50_ms") for t in range(1, num_turns + 1)]
    on, off = w["on"], w["off"]
    rows = []
    for name, key in parts:
        ratio = _fmt(w["ttft_off_over_on"].get(key), 2)
        rows.append(_row(workload, f"TTFT {name} ms", _fmt(on.get(key)), _fmt(off.get(key)),
                         f"**{ratio}**"))  # fmt: skip
    for name, key in (("output tokens/s", "output_tokens_per_s"), ("req/s", "requests_per_s")):
        ratio = _fmt(w["throughput_on_over_off"].get(key), 2)
        rows.append(_row(workload, name, _fmt(on[key], 2), _fmt(off[key], 2), f"on/off {ratio}"))
    rows.append(_row(workload, "prefix-cache hit rate", _hit(on), _hit(off), ""))
    return rows


def write_report(out: Path, args: argparse.Namespace, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-cache.json").write_text(json.dumps(record, indent=1) + "\n")
    s = record["summary"]
    rows = [r for wl in WORKLOADS for r in _table_rows(wl, s[wl], args.num_turns)]
    sp, mt = s["shared-prefix"]["on"], s["multi-turn"]["on"]
    prompt_turns = ", ".join(_fmt(mt.get(f"prompt_tokens_turn{t}"), 0)
                             for t in range(1, args.num_turns + 1))  # fmt: skip
    cmd = (f"hipfire-bench prefix-cache --repetitions {args.repetitions} "
           f"--concurrency {args.concurrency} --max-tokens {args.max_tokens}")  # fmt: skip
    md = f"""# Prefix caching: TTFT with the cache on vs off

Command: `{cmd}` (every other size is the command's default).

Machine: **CPU only, {os.cpu_count()} cores, shared with other work while measuring**.
Model: {record["model"]}, float32, KV blocks of 16 tokens, torch intra-op threads
{args.torch_threads} per server; drafter `{args.draft}`, spec mode `{args.spec_mode}`.
Two `hipfire-serve serve` processes, alike but for `--enable-prefix-caching` /
`--no-enable-prefix-caching`, each fed by `hipfire-loadgen` over loopback HTTP: closed loop at
C={args.concurrency}, greedy, {args.max_tokens} output tokens per request.

- **shared-prefix**: {args.num_groups} groups with system prompts of {args.system_prompt_len}
  words, questions of {args.question_len} words, {args.num_requests} requests; mean prompt
  {_fmt(sp["mean_prompt_tokens"], 0)} tokens (the demo model's context is 2048 tokens, so the
  prompts are shorter than the loadgen's default). `first`: each group's first request;
  `later`: the others.
- **multi-turn**: {args.num_conversations} conversations of {args.num_turns} turns, a system
  prompt of {args.mt_system_len} words, user messages of {args.user_len} words; mean prompt
  tokens by turn: {prompt_turns}. `first`: turn 1; `later`: turns 2 and on.

{METHOD}
| workload | figure | cache on | cache off | off / on |
|---|---|---|---|---|
{chr(10).join(rows)}

A `first` request finds nothing cached on either server, so its TTFT differs only through what
else the server computes meanwhile; `later` requests and turns are where the cache saves the
prefill of the shared part. The hit rate is the server's own (`prefix_cache_hits` /
`prefix_cache_queries` over the run); `-` where the server looked nothing up (cache off).
Per-repetition figures: `prefix-cache.json`.
"""
    (out / "prefix-cache.md").write_text(md)
    print(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hipfire-bench prefix-cache", description=__doc__.split("\n\n")[0], epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--model", default="demo")
    p.add_argument("--draft", default="none")
    p.add_argument("--spec-mode", default="ar", help="ar: rounds of one shape, TTFT alone")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--mt-system-len", type=int, default=512, help="multi-turn system prompt")
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    servers = {"on": Server(args, True), "off": Server(args, False)}
    reps: list[dict] = []
    try:
        urls = {side: server.wait_ready() for side, server in servers.items()}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            warm = ["shared-prefix", "--num-groups", "1", "--system-prompt-len", "64",
                    "--num-requests", "2", "--concurrency", "2", "--max-tokens", "4",
                    "--seed", "999999"]  # fmt: skip
            for side in SIDES:
                run_loadgen(urls[side], warm, out, f"warm-{side}")
            for r in range(args.repetitions):
                rep: dict = {}
                for workload in WORKLOADS:
                    order = SIDES if r % 2 == 0 else SIDES[::-1]
                    rep[workload] = {}
                    for side in order:
                        argv_w = loadgen_args(args, workload, seed=1000 * (r + 1))
                        run = run_loadgen(urls[side], argv_w, out, f"{workload}-{side}-r{r}")
                        rep[workload][side] = figures(run)
                reps.append(rep)
    finally:
        for server in servers.values():
            server.close()
    model = "the embedded demo model (hipfire_serve.demo)" if args.model == "demo" else args.model
    record = {
        "benchmark": "prefix_cache_bench",
        "model": model,
        "device": "cpu",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "shared_with_other_work": True,
        },
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summarize(reps),
        "repetitions": reps,
    }
    if args.out is not None:
        write_report(args.out, args, record)
    else:
        print(json.dumps(record["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
