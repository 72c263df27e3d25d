"""Engine rounds per second with the HTTP server attached vs the engine driven directly.

Uses project internals (the engine, for the direct run; the `hipfire-serve serve` command line,
for the HTTP run). Both sides keep `--concurrency` requests live with the same prompts, greedy
sampling and `max_tokens` (refill: a finished request is replaced at once):

    hipfire-bench server --out docs/perf               # the embedded demo model
    hipfire-bench server --model tiny --out docs/perf  # a tiny random checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The method, shown under `--help`.
METHOD = """\
- direct: a child process loops over `Engine.step()` and refills from the finished outputs,
  counting rounds, tokens and rows in shared memory;
- HTTP: `hipfire-serve serve` in a child process, fed by `--concurrency` streaming clients on
  keep-alive connections in this process; rounds, tokens and rows come from the server's
  `/metrics` (scraped only at window ends).

Both sides are started once and warmed up; then they take turns: one is resumed (SIGCONT) while
the other is frozen (SIGSTOP), for `--windows` alternating windows of `--window` seconds each.
Alternating short windows exposes both sides to the same changes in the machine's load, which
matters on a shared CPU box. The result is the median HTTP rate over the median direct rate.

Writes `server.md` and `server.json` under `--out`.
"""


PROMPTS = (
    "def add(a, b):\n    return",
    "The quick brown fox",
    "for i in range(10):\n    print(i",
    "class Slot:\n    def __init__(self, req_id):",
)
STARTUP_RE = re.compile(r"at http://127\.0\.0\.1:(\d+)/v1")
ROUNDS_RE = re.compile(r"^hipfire:round_measured_seconds_count\{[^}]*\} (\S+)$", re.M)
TOKENS_RE = re.compile(r"^hipfire:generation_tokens_total\{[^}]*\} (\S+)$", re.M)
ROWS_SUM_RE = re.compile(r"^hipfire:round_rows_sum\{[^}]*\} (\S+)$", re.M)


@dataclass
class Window:
    side: str  # "direct" | "http"
    rounds: int
    tokens: int
    rows: int
    seconds: float
    loop_cpu_s: float = 0.0  # HTTP side: CPU time of the server's event-loop thread
    engine_cpu_s: float = 0.0  # CPU time of the engine (thread or process)

    @property
    def rounds_per_s(self) -> float:
        return self.rounds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def rows_per_round(self) -> float:
        return self.rows / max(self.rounds, 1)


def engine_args(args: argparse.Namespace, model: str) -> list[str]:
    return [
        "--model", model, "--draft", args.draft, "--spec-mode", args.spec_mode,
        "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", args.kv_cache_memory,
        "--max-concurrency", str(args.concurrency), "--graphs", "off",
    ]  # fmt: skip


def request_body(i: int, max_tokens: int) -> dict:
    return {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


# --- direct side ------------------------------------------------------------------------------


def _direct_worker(argv: list[str], concurrency: int, max_tokens: int, threads: int,
                   counters, ready) -> None:  # fmt: skip
    """Child process: refill loop over Engine.step(); counters = [rounds, tokens, rows]."""
    import torch

    from hipfire_serve.engine import Engine
    from hipfire_serve.server.config import resolve
    from hipfire_serve.types import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(resolve(argv, environ={})[0])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    next_id = 0

    def add() -> None:
        nonlocal next_id
        engine.add_request(f"r{next_id}", PROMPTS[next_id % len(PROMPTS)], params)
        next_id += 1

    for _ in range(concurrency):
        add()
    ready.set()
    while True:
        outputs = engine.step()
        num_tokens = 0
        for output in outputs:
            num_tokens += sum(len(o.token_ids) for o in output.outputs)
            if output.finished:
                add()
        # Rounds as the server counts them (`hipfire:round_measured_seconds_count`): the rounds
        # the engine recorded, not step() calls.
        rounds = engine.stats().rounds
        counters[0] += len(rounds)
        counters[1] += num_tokens
        counters[2] += sum(r.num_rows for r in rounds)


class DirectSide:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        ctx = mp.get_context("spawn")
        self.counters = ctx.Array("q", 3, lock=False)
        ready = ctx.Event()
        self.proc = ctx.Process(
            target=_direct_worker,
            args=(engine_args(args, model), args.concurrency, args.max_tokens,
                  args.torch_threads, self.counters, ready),
            daemon=True,
        )  # fmt: skip
        self.proc.start()
        if not ready.wait(timeout=300):
            raise RuntimeError("direct engine did not start")

    def thread_cpu_s(self) -> tuple[float, float]:
        """(0, engine process) CPU seconds so far: the direct side has no event loop."""
        return 0.0, sum(_thread_cpu(self.proc.pid).values())

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    async def read(self) -> tuple[int, int, int]:
        return tuple(self.counters)

    def close(self) -> None:
        self.resume()
        self.proc.kill()
        self.proc.join(timeout=30)


# --- HTTP side --------------------------------------------------------------------------------


async def _stream_forever(host: str, port: int, counter, max_tokens: int) -> None:
    """One client on one keep-alive connection, streaming requests back to back.

    A raw HTTP/1.1 client that only watches for the end of each chunked SSE response, so the
    clients' own CPU use (on the same cores as the server) stays small.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while True:
            body = json.dumps(request_body(next(counter), max_tokens)).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            tail = b""
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    return
                tail = (tail + data)[-256:]
                if tail.endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in tail:
                    break
    finally:
        writer.close()


class HttpSide:
    def __init__(
        self, args: argparse.Namespace, model: str, engine_loop: str, stream_interval: int
    ) -> None:
        cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", *engine_args(args, model),
               "--port", "0", "--log-level", "warning", "--engine-loop", engine_loop,
               "--stream-interval", str(stream_interval)]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.torch_threads)}
        # Same session as the direct side: with autogroup scheduling, Linux shares CPU between
        # sessions, so a server in a session of its own would be scheduled differently.
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.engine_loop = engine_loop
        self.url = None
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited before start-up")
            match = STARTUP_RE.search(line)
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}"
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.args = args
        self.tasks: list[asyncio.Task] = []

    def start_clients(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        counter = iter(range(1 << 62))
        self.tasks = [
            asyncio.create_task(_stream_forever(host, int(port), counter, self.args.max_tokens))
            for _ in range(self.args.concurrency)
        ]

    def thread_cpu_s(self) -> tuple[float, float]:
        """(event-loop thread, engine) CPU seconds so far, from /proc (Linux). The loop runs in
        the server's main thread; the engine is the busiest other thread of the server, or of
        its child process with --engine-loop process."""
        loop_s, others = 0.0, [0.0]
        for tid, cpu_s in _thread_cpu(self.proc.pid).items():
            if tid == self.proc.pid:
                loop_s = cpu_s
            else:
                others.append(cpu_s)
        for child in self._children():
            others.append(sum(_thread_cpu(child).values()))
        return loop_s, max(others)

    def _children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(c) for c in path.read_text().split()]

    def pause(self) -> None:
        # The server and an engine child process; the clients then wait on their sockets.
        for pid in (self.proc.pid, *self._children()):
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in (self.proc.pid, *self._children()):
            os.kill(pid, signal.SIGCONT)

    async def read(self) -> tuple[int, int, int]:
        reader, writer = await asyncio.open_connection(*self.url.removeprefix("http://").split(":"))
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = (await reader.read(-1)).decode()
        writer.close()
        return tuple(
            int(float(rx.search(text).group(1))) for rx in (ROUNDS_RE, TOKENS_RE, ROWS_SUM_RE)
        )

    async def close(self) -> None:
        self.resume()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _thread_cpu(pid: int) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


# --- the alternation --------------------------------------------------------------------------


async def _measure(side, name: str, seconds: float) -> Window:
    side.resume()
    await asyncio.sleep(0.3)  # let it get back into its stride
    cpu_before = side.thread_cpu_s()
    before = await side.read()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after = await side.read()
    elapsed = time.monotonic() - t0
    cpu_after = side.thread_cpu_s()
    side.pause()
    r, t, w = (a - b for a, b in zip(after, before))
    loop_s, engine_s = (a - b for a, b in zip(cpu_after, cpu_before))
    return Window(name, r, t, w, elapsed, loop_s, engine_s)


async def run_mode(args: argparse.Namespace, model: str) -> list[Window]:
    direct = DirectSide(args, model)
    direct.pause()
    sides: list[tuple[Any, str]] = [(direct, "direct")]
    windows: list[Window] = []
    try:
        for variant in args.http_variants.split(","):
            loop, _, interval = variant.partition(":")
            http = HttpSide(args, model, loop, int(interval or 1))
            http.start_clients()
            await asyncio.sleep(args.warmup)  # warm up, then freeze until its turn
            http.pause()
            sides.append((http, f"http-{loop}-every-{interval or 1}"))
        direct.resume()
        await asyncio.sleep(args.warmup)
        direct.pause()
        for i in range(args.windows):
            order = sides[i % len(sides) :] + sides[: i % len(sides)]  # rotate who goes first
            for side, name in order:
                window = await _measure(side, name, args.window)
                windows.append(window)
                print(
                    f"[{args.spec_mode} {i + 1}] {name:>22}: {window.rounds_per_s:7.1f} rounds/s"
                    f" {window.tokens_per_s:7.0f} tokens/s {window.rows_per_round:5.1f} rows/round"
                )
    finally:
        direct.close()
        for side, _name in sides[1:]:
            await side.close()
    return windows


# --- report -----------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(windows: list[Window]) -> dict:
    def of(side: str) -> list[Window]:
        return [w for w in windows if w.side == side]

    direct_rps = _median([w.rounds_per_s for w in of("direct")])
    out: dict[str, Any] = {
        "windows": [{**asdict(w), "rounds_per_s": w.rounds_per_s} for w in windows],
        "direct": {
            "median_rounds_per_s": direct_rps,
            "median_rows_per_round": _median([w.rows_per_round for w in of("direct")]),
            "median_engine_cpu_ms_per_round": _median(
                [1e3 * w.engine_cpu_s / max(w.rounds, 1) for w in of("direct")]
            ),
            "median_engine_cores": _median([w.engine_cpu_s / w.seconds for w in of("direct")]),
        },
    }
    for side in sorted({w.side for w in windows} - {"direct"}):
        ws = of(side)
        http_rps = _median([w.rounds_per_s for w in ws])
        out[side] = {
            "median_rounds_per_s": http_rps,
            "over_direct_rounds_per_s": http_rps / direct_rps,
            "median_rows_per_round": _median([w.rows_per_round for w in ws]),
            # CPU per round of the server's event loop and of its engine (thread or process);
            # the loop's share is what HTTP can cost the engine when they share the GIL.
            "median_loop_cpu_ms_per_round": _median(
                [1e3 * w.loop_cpu_s / max(w.rounds, 1) for w in ws]
            ),
            "median_engine_cpu_ms_per_round": _median(
                [1e3 * w.engine_cpu_s / max(w.rounds, 1) for w in ws]
            ),
            # CPU the engine got per second of wall time: rounds/s = cores / (s per round)
            "median_engine_cores": _median([w.engine_cpu_s / w.seconds for w in ws]),
        }
    return out


def resolve_model(name: str) -> tuple[str, str]:
    """(path for --model, description)."""
    if name == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.fixtures.tiny_models import make_tiny_model

        path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", arch="llama")
        return str(path), "tiny random Llama (2 layers, hidden 64; tests/fixtures/tiny_models.py)"
    if name == "demo":
        return "demo", "the embedded demo model (hipfire_serve.demo)"
    return name, name


def write_report(out: Path, args, model_desc: str, runs: dict[str, list[Window]]) -> None:
    summaries = {mode: summarize(windows) for mode, windows in runs.items()}
    record = {
        "benchmark": "server_bench",
        "model": model_desc,
        "device": "cpu",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "spec_mode")},
        "spec_modes": summaries,
        "target": 0.9,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "server.json").write_text(json.dumps(record, indent=1) + "\n")
    rows = []
    for mode, s in summaries.items():
        d = s["direct"]
        rows.append(
            f"| `{mode}` | direct | {d['median_rounds_per_s']:.1f} | | "
            f"{d['median_rows_per_round']:.1f} | - / {d['median_engine_cpu_ms_per_round']:.2f} | "
            f"{d['median_engine_cores']:.2f} |"
        )
        for side in sorted(k for k in s if k.startswith("http-")):
            h = s[side]
            rows.append(
                f"| `{mode}` | {side} | {h['median_rounds_per_s']:.1f} | "
                f"**{h['over_direct_rounds_per_s']:.3f}** | {h['median_rows_per_round']:.1f} | "
                f"{h['median_loop_cpu_ms_per_round']:.2f} / "
                f"{h['median_engine_cpu_ms_per_round']:.2f} | {h['median_engine_cores']:.2f} |"
            )
    cores = "engine CPU, cores"
    md = f"""# Server overhead: engine rounds per second with HTTP attached

Command: `hipfire-bench server --model {args.model} --spec-modes
{",".join(runs)} --http-variants {args.http_variants} --concurrency {args.concurrency}
--max-tokens {args.max_tokens} --windows {args.windows} --window {args.window}`.

Machine: **CPU only, {os.cpu_count()} cores, shared with other work while measuring**. Model:
{model_desc}; drafter `{args.draft}`; torch intra-op threads {args.torch_threads}. Every side
keeps {args.concurrency} greedy requests of {args.max_tokens} tokens live (refill). An HTTP side
is `hipfire-serve serve --engine-loop L --stream-interval N` (side `http-L-every-N`), fed by
{args.concurrency} streaming clients (keep-alive connections, one event loop) in the benchmark
process, on the same cores; the direct side is a process looping over `Engine.step()`. The
sides take turns in {args.window} s windows ({args.windows} each), the others frozen with
SIGSTOP, so that all see the same machine load.

| spec mode | side | rounds/s | / direct | rows/round | CPU ms/round: loop / engine | {cores} |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Target: HTTP / direct >= 0.90. `ar` fixes the round shape (one row per decoding request), so it
isolates the server's cost; under `adaptive` the policy picks routes from its own calibration,
so the sides may run rounds of different sizes (see rows/round). The last column is the CPU time
per round of the server's event-loop thread (all HTTP work: parsing, SSE encoding, socket
writes, metrics) and of the engine (thread, or child process; for the direct side its
process), read from `/proc`; the last column is the engine's CPU time per second of wall time
(rounds/s = that / CPU seconds per round). Medians over the windows; per-window numbers:
`server.json`.
"""
    (out / "server.md").write_text(md)
    print(md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="hipfire-bench server",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--model", default="demo", help="'demo', 'tiny' or a model directory")
    parser.add_argument("--draft", default="auto", help="auto: the demo draft model with demo")
    parser.add_argument("--spec-modes", default="ar,adaptive", help="comma-separated")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--http-variants",
        default="thread:1,process:1,thread:4",
        help="server variants as ENGINE_LOOP:STREAM_INTERVAL, comma-separated",
    )
    parser.add_argument("--windows", type=int, default=8, help="measurement windows per side")
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model, model_desc = resolve_model(args.model)
    runs: dict[str, list[Window]] = {}
    for mode in args.spec_modes.split(","):
        args.spec_mode = mode
        runs[mode] = asyncio.run(run_mode(args, model))
    if args.out is not None:
        write_report(args.out, args, model_desc, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
