"""SIGTERM on a real `hipfire-serve serve` process: drain, then exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

STARTUP_RE = re.compile(r"at http://127\.0\.0\.1:(\d+)/v1")


def _start(model_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "hipfire_serve.cli",
        "serve",
        "--model",
        str(model_dir),
        "--draft",
        "ngram",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--max-model-len",
        "512",
        "--graphs",
        "off",
        "--port",
        "0",
        "--log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = STARTUP_RE.search(line)
        if match:
            # keep draining the pipe so the server never blocks on a full one
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{match.group(1)}"
    proc.kill()
    pytest.fail("server did not start:\n" + "".join(lines))


def _stream_in_background(url: str, body: dict, results: list) -> threading.Thread:
    def run():
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            results.append(response.read().decode())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_running(url: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        match = re.search(r"^hipfire:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        if match and float(match.group(1)) >= count:
            return
        time.sleep(0.02)
    pytest.fail("requests did not start")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(tiny_model_dir, engine_loop):
    proc, url = _start(tiny_model_dir, "--drain-timeout", "60", "--engine-loop", engine_loop)
    try:
        results: list[str] = []
        # long enough that the requests are still running while the drain is checked, even on
        # a fast, idle machine (~480 rounds)
        body = {"prompt": "for i in", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        threads = [_stream_in_background(url, body, results) for _ in range(3)]
        _wait_running(url, 3)
        engine_children = _children(proc.pid) if engine_loop == "process" else []
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "drain did not start"
            time.sleep(0.02)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        for thread in threads:
            thread.join(timeout=120)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert all(_gone(child) for child in engine_children)  # no orphaned engine process
    assert len(results) == 3
    for raw in results:
        assert raw.endswith("data: [DONE]\n\n")
        last = json.loads(raw.split("\n\n")[-3][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "length"


def test_drain_deadline_aborts_the_rest_and_exits_0(tiny_model_dir):
    proc, url = _start(tiny_model_dir, "--drain-timeout", "0")
    try:
        streamed: list[str] = []
        body = {"prompt": "for i in", "max_tokens": 240, "ignore_eos": True}
        stream_thread = _stream_in_background(url, body, streamed)
        plain: list[httpx.Response] = []
        plain_thread = threading.Thread(
            target=lambda: plain.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        )
        plain_thread.start()
        _wait_running(url, 2)
        proc.send_signal(signal.SIGTERM)
        stream_thread.join(timeout=60)
        plain_thread.join(timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert plain[0].status_code == 503
    assert plain[0].json()["error"]["type"] == "service_unavailable_error"
    events = streamed[0].split("\n\n")
    assert events[-2] == "data: [DONE]"
    assert "service_unavailable_error" in events[-3]
