"""Processes for the live-stack test: a real `hipfire-serve serve` and a real Prometheus, each
on a free loopback port, started and stopped by the test."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.deploy.deploy_files import PROMETHEUS_YML, REPO, RULE_FILES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str, module: str) -> list[str]:
    """The installed console script next to this interpreter, else the same entry point run
    as a module (a checkout used without `pip install -e`)."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s:\n{log.read_text()}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(model: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = workdir / "server.log"
    cmd = [
        *console_script("hipfire-serve", "hipfire_serve.cli"),
        "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--max-concurrency", "8", "--log-level", "warning",
        "--drain-timeout", "2",
        # The n-gram drafter needs no second model: the speculative metrics get data too.
        "--draft", "ngram", "--spec-mode", "adaptive",
    ]  # fmt: skip
    with log.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{root}/health", 120, proc, log)
    except Exception:
        stop(proc)
        raise
    return proc, root


def prometheus_config(server_root: str, prom_port: int) -> dict:
    """deploy/prometheus/prometheus.yml pointed at the live server, scraping twice a second so a
    run of a few seconds leaves several samples; the deploy rule files are loaded as they are."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(
        scrape_interval="500ms", scrape_timeout="500ms", evaluation_interval="500ms"
    )
    config["rule_files"] = [str(p) for p in RULE_FILES]
    for job in config["scrape_configs"]:
        if job["job_name"] == "hipfire-serve":
            job["static_configs"][0]["targets"] = [server_root.removeprefix("http://")]
        else:
            job["static_configs"][0]["targets"] = [f"127.0.0.1:{prom_port}"]
    return config


def start_prometheus(server_root: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(server_root, port)))
    log = workdir / "prometheus.log"
    cmd = [
        "prometheus", f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    with log.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/-/ready", 60, proc, log)
    except Exception:
        stop(proc)
        raise
    return proc, url


def query(prom_url: str, expr: str, at: float | None = None) -> dict:
    """An instant query through Prometheus' HTTP API, at unix time `at` (default: now); returns
    the JSON answer, errors included."""
    params: dict = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    resp = httpx.get(f"{prom_url}/api/v1/query", params=params, timeout=10)
    return resp.json()


def wait_for(prom_url: str, expr: str, timeout_s: float) -> None:
    """Until `expr` returns a non-empty result (e.g. a scrape has seen something)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = query(prom_url, expr)
        if answer["status"] == "success" and answer["data"]["result"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"Prometheus never returned data for {expr}")
