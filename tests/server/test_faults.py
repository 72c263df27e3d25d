"""Faults on loopback: the engine killed or stalled (thread and process loop), a second signal
during a drain, an engine child whose server goes away, a multi-MiB prompt beside live streams.

Each test prints what it measured (run with `-s`); `docs/reliability.md` tabulates those numbers.
Time bounds asserted here are loose (a fault unnoticed means seconds more, or forever).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hipfire_serve.server.engine_client import EngineClient
from hipfire_serve.server.supervisor import EngineSupervisor
from tests.server.conftest import start_real_server
from tests.server.test_drain import _children, _gone, _start, _wait_running

ROOT = Path(__file__).resolve().parents[2]
LONG = {"prompt": "for i in", "max_tokens": 200, "ignore_eos": True, "speculation": "off"}


class Stream(threading.Thread):
    """One streamed completion, each `data:` event kept with its arrival time."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[tuple[float, str]] = []
        self.first = threading.Event()
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        body = {**self.body, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.first.set()
        except httpx.TransportError:
            pass  # the server went away mid-stream (the signal tests end it)

    def gaps(self, begin: float, end: float) -> list[float]:
        """Gaps between this stream's chunks that overlap [begin, end], TTFT left out."""
        times = [t for t, _ in self.events[1:]]
        return [b - a for a, b in itertools.pairwise(times) if a <= end and b >= begin]

    def error_type(self) -> str | None:
        """The error event's type, checked to be followed by [DONE]."""
        self.join(30)
        payloads = [p for _, p in self.events]
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2]).get("error")
        return error and error["type"]


class Post(threading.Thread):
    """One non-streamed request in the background."""

    def __init__(self, url: str, body: dict | bytes) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None
        self.done_at = 0.0
        self.start()

    def run(self) -> None:
        url = self.url + "/v1/completions"
        if isinstance(self.body, bytes):  # encoded ahead: a big body's encoding holds the GIL
            headers = {"content-type": "application/json"}
            self.response = httpx.post(url, content=self.body, headers=headers, timeout=60)
        else:
            self.response = httpx.post(url, json=self.body, timeout=60)
        self.done_at = time.monotonic()

    def result(self) -> httpx.Response:
        self.join(30)
        return self.response


def _wait_health(url: str, status: int, timeout_s: float = 60.0) -> float:
    """Seconds until /health answers `status`."""
    began = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == status:
                return time.monotonic() - began
        except httpx.TransportError:
            pass
        assert time.monotonic() - began < timeout_s, f"/health never answered {status}"
        time.sleep(0.02)


def _assert_retry_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable_error"


def _alive(pid: int) -> bool:
    """Running (a zombie that only waits for its parent to reap it counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _exits(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith(f"hipfire:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


# --- the restart budget ------------------------------------------------------------------------


class RestartableEngine(EngineClient):
    """A transport with nothing behind it whose restarts always succeed."""

    def __init__(self) -> None:
        super().__init__()
        self.num_restarts = 0

    def _send(self, command) -> None:
        pass

    @property
    def running(self) -> bool:
        return True

    @property
    def can_restart(self) -> bool:
        return True

    async def restart(self) -> None:
        self.num_restarts += 1
        self.fault = None


def test_restarts_past_the_budget_end_the_server():
    async def scenario() -> tuple[int, list[str]]:
        engine = RestartableEngine()
        supervisor = EngineSupervisor(engine, stall_timeout_s=0, max_restarts=1)
        fatal: list[str] = []
        supervisor.on_fatal = fatal.append
        supervisor.start()
        for n in (1, 2):
            engine.report_fault(f"fault {n}")
            await asyncio.sleep(0.05)
        await supervisor.stop()
        return engine.num_restarts, fatal

    assert asyncio.run(scenario()) == (1, ["fault 2"])


def test_a_frozen_server_does_not_blame_its_engine():
    """Stall time counts only while the supervisor runs: a server that was stopped as a whole
    (SIGSTOP, a paused VM) resumes without failing a healthy engine."""

    async def scenario() -> tuple[str | None, str | None]:
        engine = RestartableEngine()
        engine._adds["req"] = asyncio.get_running_loop().create_future()  # waits on the engine
        supervisor = EngineSupervisor(engine, stall_timeout_s=0.4, max_restarts=0)
        supervisor.check()
        supervisor._last_tick -= 100.0  # as if the process had been frozen for 100 s
        after_freeze = supervisor.check()
        for _ in range(8):
            await asyncio.sleep(0.1)
            later = supervisor.check()
        return after_freeze, later

    after_freeze, later = asyncio.run(scenario())
    assert after_freeze is None
    assert later is not None and "no progress" in later


# --- thread loop (engine double: no model to load) ---------------------------------------------


class EngineThreadKilled(BaseException):
    """Escapes the driver's `except Exception`, as a bug in the loop itself would."""


def _die() -> None:
    raise EngineThreadKilled("injected")


def _wait_exit(running, timeout_s: float = 10.0) -> float:
    began = time.monotonic()
    running._thread.join(timeout_s)
    assert not running._thread.is_alive(), "the server did not exit"
    return time.monotonic() - began


def test_thread_engine_death_fails_everyone_and_exits_1(double_server):
    running = double_server(round_s=0.02, max_model_len=512)
    stream = Stream(running.url, {"prompt": "a", "max_tokens": 400})
    plain = Post(running.url, {"prompt": "b", "max_tokens": 400})
    assert stream.first.wait(10)
    killed_at = time.monotonic()
    running.engine.step = _die  # the engine thread reads it at its next round
    assert stream.error_type() == "service_unavailable_error"
    _assert_retry_503(plain.result())
    print(f"[fault] thread death: clients answered {plain.done_at - killed_at:.3f} s after")
    _wait_exit(running)
    assert running.built.server.exit_status == 1


def test_thread_engine_stall_fails_everyone_and_exits_1(double_server):
    running = double_server(round_s=0.01, max_model_len=512, engine_stall_timeout=1.0)
    stream = Stream(running.url, {"prompt": "a", "max_tokens": 400})
    assert stream.first.wait(10)
    running.engine.round_s = 4.0
    stalled_at = time.monotonic()
    waiting = Post(running.url, {"prompt": "b", "max_tokens": 4})  # never taken in
    _assert_retry_503(waiting.result())
    noticed_s = waiting.done_at - stalled_at
    assert stream.error_type() == "service_unavailable_error"
    print(f"[fault] thread stall (bound 1.0 s): clients answered after {noticed_s:.3f} s")
    assert 0.9 <= noticed_s < 3.0
    _wait_exit(running)
    assert running.built.server.exit_status == 1


def test_request_timeout_covers_the_wait_for_the_engine(double_server):
    running = double_server(round_s=0.01, request_timeout=0.5, engine_stall_timeout=0)
    stream = Stream(running.url, {"prompt": "a", "max_tokens": 100})
    assert stream.first.wait(10)
    running.engine.round_s = 1.2
    began = time.monotonic()
    waiting = Post(running.url, {"prompt": "b", "max_tokens": 4}).result()
    assert waiting.status_code == 504, waiting.text
    waited_s = time.monotonic() - began
    print(f"[fault] engine not taking requests in, timeout 0.5 s: 504 after {waited_s:.3f} s")
    assert waited_s < 1.5
    running.engine.round_s = 0.0
    assert httpx.get(running.url + "/health", timeout=5).status_code == 200


# --- process loop (real tiny engine in a child; one server, restarted by each test) ----------


@pytest.fixture(scope="module")
def process_server(tiny_model_dir):
    running = start_real_server(tiny_model_dir, engine_loop="process", engine_stall_timeout=1.5)
    yield running
    running.stop()


def _recovered(running, fault_at: float, what: str) -> None:
    """Waits for the fresh child; checks gauges are back at 0 and a request is served."""
    _wait_health(running.url, 200)
    restarted_s = time.monotonic() - fault_at
    assert _gauge(running.url, "num_requests_running") == 0
    ok = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    print(f"[fault] {what}: served again {restarted_s:.2f} s after the fault")


def test_process_engine_killed_is_restarted(process_server):
    url = process_server.url
    stream = Stream(url, LONG)
    plain = Post(url, LONG)
    assert stream.first.wait(30)
    killed_at = time.monotonic()
    os.kill(process_server.engine.pid, signal.SIGKILL)
    _assert_retry_503(plain.result())
    assert stream.error_type() == "service_unavailable_error"
    answered_s = plain.done_at - killed_at
    during = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    _assert_retry_503(during)  # while the fresh child loads
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    print(f"[fault] process killed: clients answered {answered_s:.3f} s after")
    _recovered(process_server, killed_at, "process killed")


def test_process_engine_stalled_is_killed_and_restarted(process_server):
    url = process_server.url
    stream = Stream(url, LONG)
    assert stream.first.wait(30)
    old_pid = process_server.engine.pid
    os.kill(old_pid, signal.SIGSTOP)
    stalled_at = time.monotonic()
    try:
        waiting = Post(url, {"prompt": "x", "max_tokens": 2})  # never taken in
        _assert_retry_503(waiting.result())
        assert stream.error_type() == "service_unavailable_error"
        noticed_s = waiting.done_at - stalled_at
        assert _gone(old_pid, 10)
    finally:
        if _alive(old_pid):
            os.kill(old_pid, signal.SIGKILL)
    print(f"[fault] process stall (bound 1.5 s): clients answered after {noticed_s:.3f} s")
    assert 1.4 <= noticed_s < 3.5
    _recovered(process_server, stalled_at, "process stall")


# --- signals and the engine child's lifetime ---------------------------------------------------


@pytest.mark.parametrize(
    ("engine_loop", "sig"), [("thread", signal.SIGTERM), ("process", signal.SIGINT)]
)
def test_second_signal_exits_at_once(tiny_model_dir, engine_loop, sig):
    proc, url = _start(tiny_model_dir, "--drain-timeout", "60", "--engine-loop", engine_loop)
    try:
        stream = Stream(url, {**LONG, "max_tokens": 480})
        _wait_running(url, 1)
        children = _children(proc.pid) if engine_loop == "process" else []
        proc.send_signal(sig)
        _wait_health(url, 503, 10)
        second_at = time.monotonic()
        proc.send_signal(sig)
        status = proc.wait(timeout=10)
        exited_s = time.monotonic() - second_at
    finally:
        proc.kill()
    assert status == 128 + sig  # an exit status: not killed by the signal, no abort
    assert all(_gone(child, 5) for child in children)
    stream.join(10)
    print(f"[fault] second {sig.name} ({engine_loop}): exited {exited_s:.3f} s after, {status}")


_LIFELINE_SCRIPT = """
import multiprocessing as mp, os, time
from tests.server.lifeline_child import sleep_watching_parent
ctx = mp.get_context("spawn")
pids = []
for _ in range(2):
    child_end, own_end = ctx.Pipe(duplex=False)
    p = ctx.Process(target=sleep_watching_parent, args=(child_end, os.getpid()), daemon=True)
    p.start()
    child_end.close()
    pids.append((p.pid, own_end))
print(pids[0][0], pids[1][0], flush=True)
input()
pids[0][1].close()  # the first child's pipe guard fires while its parent lives
time.sleep(120)
"""


def test_engine_child_never_outlives_its_server():
    proc = subprocess.Popen(
        [sys.executable, "-c", _LIFELINE_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        first, second = (int(p) for p in proc.stdout.readline().split())
        watching = {int(proc.stdout.readline().split()[1]) for _ in range(2)}
        assert watching == {first, second}
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert _exits(first, 10)  # its pipe closed
        time.sleep(0.3)
        assert _alive(second)
        proc.kill()  # no clean-up runs in a killed server
        killed_at = time.monotonic()
        assert _exits(second, 5)
        print(
            f"[fault] server killed: engine child gone {time.monotonic() - killed_at:.3f} s after"
        )
    finally:
        proc.kill()
        proc.wait()


# --- a big prompt beside live streams ----------------------------------------------------------


def test_big_prompt_leaves_other_streams_flowing(server):
    """A 3.7 MiB prompt is tokenized off the event loop (and rejected: it is past the context)
    while a stream and /health keep their cadence."""
    url = server.url
    stop = threading.Event()
    streams: list[Stream] = []

    def keep_streaming() -> None:
        while not stop.is_set():
            streams.append(Stream(url, {**LONG, "max_tokens": 240}))
            streams[-1].join(60)

    streamer = threading.Thread(target=keep_streaming, daemon=True)
    streamer.start()
    time.sleep(1.5)
    text = ("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n" * 60000)[
        : int(3.7 * (1 << 20))
    ]
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    health: list[float] = []
    began = time.monotonic()
    big = Post(url, body)
    while big.is_alive():
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        health.append(time.monotonic() - t0)
        time.sleep(0.05)
    ended = big.done_at
    stop.set()
    streamer.join(60)
    response = big.result()
    assert response.status_code == 400 and "maximum context length" in response.text
    baseline = [g for stream in streams for g in stream.gaps(0.0, began)]
    during = [g for stream in streams for g in stream.gaps(began, ended)]
    assert baseline and during
    growth_s = max(during) - max(baseline)
    print(
        f"[fault] 3.7 MiB prompt for {ended - began:.2f} s: stream gap max "
        f"{max(baseline) * 1e3:.0f} ms before, {max(during) * 1e3:.0f} ms during "
        f"(+{growth_s * 1e3:.0f} ms); /health max {max(health) * 1e3:.0f} ms"
    )
    assert growth_s < 0.5  # on the event loop it was the whole tokenization: seconds
