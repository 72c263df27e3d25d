"""Engine rounds per second with the HTTP server attached vs the engine driven directly.

Uses project internals (the engine, for the direct run; the `hipfire-serve serve` command line,
for the HTTP run). Both sides keep `--concurrency` requests live with the same prompts, greedy
sampling and `max_tokens` (refill: a finished request is replaced at once):

- direct: a child process loops over `Engine.step()` and refills from the finished outputs,
  counting rounds, tokens and rows in shared memory;
- HTTP: `hipfire-serve serve` in a child process, fed by `--concurrency` streaming clients on
  keep-alive connections in this process; rounds, tokens and rows come from the server's
  `/metrics` (scraped only at window ends).

Both sides are started once and warmed up; then they take turns: one is resumed (SIGCONT) while
the other is frozen (SIGSTOP), for `--windows` alternating windows of `--window` seconds each.
Alternating short windows exposes both sides to the same changes in the machine's load, which
matters on a shared CPU box. The result is the median HTTP rate over the median direct rate.

    python -m loadtests.server_bench --out docs/perf               # the embedded demo model
    python -m loadtests.server_bench --model tiny --out docs/perf  # a tiny random checkpoint

Writes `server.md` and `server.json` under `--out`.
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
        rows = sum(r.num_rows for r in engine.stats().rounds)
        counters[0] += 1
        counters[1] += num_tokens
        counters[2] += rows


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
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        cmd = [sys.executable, "-m", "hipfire_serve.cli", "serve", *engine_args(args, model),
               "--port", "0", "--log-level", "warning"]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.torch_threads)}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
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

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)  # the clients then wait on their sockets

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

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


# --- the alternation --------------------------------------------------------------------------


async def _measure(side, name: str, seconds: float) -> Window:
    side.resume()
    await asyncio.sleep(0.3)  # let it get back into its stride
    before = await side.read()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after = await side.read()
    elapsed = time.monotonic() - t0
    side.pause()
    r, t, w = (a - b for a, b in zip(after, before))
    return Window(name, r, t, w, elapsed)


async def run_mode(args: argparse.Namespace, model: str) -> list[Window]:
    direct = DirectSide(args, model)
    direct.pause()
    http = HttpSide(args, model)
    http.start_clients()
    windows: list[Window] = []
    try:
        await asyncio.sleep(args.warmup)  # HTTP side warms up
        http.pause()
        direct.resume()
        await asyncio.sleep(args.warmup)  # direct side warms up
        direct.pause()
        for i in range(args.windows):
            order = [(direct, "direct"), (http, "http")]
            if i % 2:
                order.reverse()  # neither side always goes first
            for side, name in order:
                window = await _measure(side, name, args.window)
                windows.append(window)
                print(
                    f"[{args.spec_mode} {i + 1}] {name:>6}: {window.rounds_per_s:7.1f} rounds/s"
                    f" {window.tokens_per_s:7.0f} tokens/s {window.rows_per_round:5.1f} rows/round"
                )
    finally:
        direct.close()
        await http.close()
    return windows


# --- report -----------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(windows: list[Window]) -> dict:
    direct = [w.rounds_per_s for w in windows if w.side == "direct"]
    http = [w.rounds_per_s for w in windows if w.side == "http"]
    return {
        "windows": [{**asdict(w), "rounds_per_s": w.rounds_per_s} for w in windows],
        "median_direct_rounds_per_s": _median(direct),
        "median_http_rounds_per_s": _median(http),
        "http_over_direct_rounds_per_s": _median(http) / _median(direct),
        "median_direct_rows_per_round": _median(
            [w.rows_per_round for w in windows if w.side == "direct"]
        ),
        "median_http_rows_per_round": _median(
            [w.rows_per_round for w in windows if w.side == "http"]
        ),
    }


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
        "pass": all(s["http_over_direct_rounds_per_s"] >= 0.9 for s in summaries.values()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "server.json").write_text(json.dumps(record, indent=1) + "\n")
    rows = []
    for mode, s in summaries.items():
        ratio = s["http_over_direct_rounds_per_s"]
        rows.append(
            f"| `{mode}` | {s['median_direct_rounds_per_s']:.1f} | "
            f"{s['median_http_rounds_per_s']:.1f} | **{ratio:.3f}** | "
            f"{s['median_direct_rows_per_round']:.1f} / {s['median_http_rows_per_round']:.1f} |"
        )
    md = f"""# Server overhead: engine rounds per second with HTTP attached

Command: `python -m loadtests.server_bench --model {args.model} --spec-modes
{",".join(runs)} --concurrency {args.concurrency} --max-tokens {args.max_tokens} --windows
{args.windows} --window {args.window}`.

Machine: **CPU only, {os.cpu_count()} cores, shared with other work while measuring**. Model:
{model_desc}; drafter `{args.draft}`; torch intra-op threads {args.torch_threads}. Each side
keeps {args.concurrency} greedy requests of {args.max_tokens} tokens live (refill). The HTTP
side is `hipfire-serve serve` in its own process with {args.concurrency} streaming clients
(keep-alive connections, one event loop) in the benchmark process, on the same cores; the direct
side is a process looping over `Engine.step()`. The two sides take turns in {args.window} s
windows ({args.windows} each), the idle one frozen with SIGSTOP, so that both see the same
machine load.

| spec mode | direct rounds/s | HTTP rounds/s | HTTP / direct | rows/round, direct / HTTP |
|---|---|---|---|---|
{chr(10).join(rows)}

Target: HTTP / direct >= 0.90. `ar` fixes the round shape (one row per decoding request), so it
isolates the server's cost; under `adaptive` the policy picks routes from its own calibration,
so the two sides may run rounds of different sizes (see the rows column). Per-window numbers:
`server.json`.
"""
    (out / "server.md").write_text(md)
    print(md)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="'demo', 'tiny' or a model directory")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--spec-modes", default="ar,adaptive", help="comma-separated")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
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
