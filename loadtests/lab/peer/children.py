"""The parent's side of the child processes: their environment (the repository on PYTHONPATH;
for vLLM a staged bundle's paths in front of it), whether `import vllm` works in one, and
running a child to its deadline. A child runs in a process group of its own, so one stopped at
its deadline takes its own children (vLLM's engine core) with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Seconds a child may run past its deadline (a point under way finishes) before it is stopped.
GRACE_S = 45.0
PROBE_TIMEOUT_S = 180.0


def child_env(engine: str, vllm_pythonpath: str = "") -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)]
    if engine == "vllm" and vllm_pythonpath:
        paths.insert(0, vllm_pythonpath)
        # the staged bundle carries no FlashInfer: vLLM's default sampler would need it
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def probe_vllm(vllm_pythonpath: str = "") -> tuple[str | None, str]:
    """(vLLM's version, '') where `import vllm` works in a child process, else (None, the
    reason in one line)."""
    code = "import vllm; print(vllm.__version__)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env("vllm", vllm_pythonpath),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return None, f"`import vllm` took over {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return proc.stdout.strip().splitlines()[-1], ""
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return None, lines[-1].strip() if lines else f"exit status {proc.returncode}"


def run_child(module: str, args: list[str], env: dict[str, str], deadline: float) -> int:
    """Runs `python -m module *args` until it exits or `deadline` + GRACE_S (epoch seconds);
    its output goes to this process's. Returns its exit status (-9 when stopped)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], env=env, cwd=ROOT, start_new_session=True
    )
    try:
        return proc.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return -9


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def read_result(path: Path, engine: str, status: int) -> dict:
    """The child's result JSON; where it wrote none, a result holding the exit status."""
    if path.is_file():
        result = json.loads(path.read_text())
    else:
        result = {"engine": engine, "skipped": [], "errors": []}
        result["error"] = f"the child wrote no result (exit status {status})"
    if status == -9:
        result.setdefault("errors", []).append(
            {"error": f"stopped {GRACE_S:.0f} s past its deadline"}
        )
    result["exit_status"] = status
    return result
