"""The whole stack on loopback: a live `hipfire-serve serve` on a tiny model, a real Prometheus
scraping it with the deploy config and rules, and `hipfire-loadgen refill` at C = 1, 2, 4 as the
load. Checks the load generator's outputs and token counts against the server's counters, then
evaluates every PromQL expression of the dashboard and the rules through Prometheus' HTTP API."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time

import httpx
import pytest

from loadtests.promtext import Snapshot
from tests.deploy.deploy_files import (
    REPO,
    dashboard_exprs,
    exported_families,
    rule_exprs,
    rules,
    variable_queries,
)
from tests.deploy.live_stack import (
    console_script,
    query,
    start_prometheus,
    start_server,
    stop,
)

CONCURRENCY = (1, 2, 4)
WAVES = 2
MAX_TOKENS = 12
# Panels that must show data right after a load run (the others may legitimately be empty on
# a server without a drafter, e.g. acceptance).
PANELS_WITH_DATA = (
    "Output tokens/s", "Live slots", "Throughput (tokens/s)", "TTFT p50 / p99", "ITL p50 / p99",
    "E2E latency p50 / p99", "Live slots vs capacity", "Tokens/s per tenant",
)  # fmt: skip


def _need_prometheus():
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.environ.get("CI"):
        pytest.fail("prometheus is missing in CI (scripts/_services.sh installs it)")
    pytest.skip("prometheus not installed")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    _need_prometheus()
    from tests.fixtures.tiny_models import make_tiny_model

    work = tmp_path_factory.mktemp("stack")
    # A context long enough for the longest shipped prompts under the tiny byte-level BPE.
    model = make_tiny_model(work / "tiny-llama", arch="llama", max_position_embeddings=4096)
    server, server_root = start_server(model, work)
    try:
        prom, prom_url = start_prometheus(server_root, work)
    except Exception:
        stop(server)
        raise
    try:
        _wait_for(prom_url, 'up{job="hipfire-serve"} == 1', 30)
        before = httpx.get(f"{server_root}/metrics").text
        out = work / "loadgen"
        cmd = [
            *console_script("hipfire-loadgen", "loadtests.cli"),
            "refill", "--base-url", f"{server_root}/v1",
            "--concurrency", ",".join(map(str, CONCURRENCY)), "--waves", str(WAVES),
            "--max-tokens", str(MAX_TOKENS), "--cohort", "mixed", "--out", str(out),
            "--label", "live", "--no-progress",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        after = httpx.get(f"{server_root}/metrics").text
        # Two scrapes and rule evaluations after the load, so rates and rules cover it.
        time.sleep(2.5)
        yield {
            "prom": prom_url, "loadgen": done, "out": out, "before": before, "after": after,
        }  # fmt: skip
    finally:
        stop(prom)
        stop(server)


def _wait_for(prom_url: str, expr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = query(prom_url, expr)
        if answer["status"] == "success" and answer["data"]["result"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"Prometheus never saw {expr}")


def test_refill_reports_and_token_counts_match_the_server(stack):
    done = stack["loadgen"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "C=4" in done.stdout  # the terminal table
    out = stack["out"]
    report = json.loads((out / "live.json").read_text())
    for kind in ("throughput", "latency", "timeline"):
        assert (out / f"live-{kind}.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "live.csv").read_text().splitlines()) == 1 + len(CONCURRENCY)
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == list(CONCURRENCY)
    for run in runs:
        num = WAVES * run["concurrency"]
        assert run["num_ok"] == num
        assert run["num_output_tokens"] == num * MAX_TOKENS  # ignore_eos: exact counts
        # Per run, the server's own counters (scraped by the load generator) agree.
        assert run["server"]["generation_tokens"] == run["num_output_tokens"]
        assert run["server"]["prompt_tokens"] == run["num_prompt_tokens"]
        assert run["server"]["requests_succeeded"] == num
        assert run["refill_tokens_per_s"] > 0
        assert run["ttft"]["p99_ms"] >= run["ttft"]["p50_ms"] > 0
    assert runs[0]["full_live_tokens_per_s"] > 0  # C=1 always has full-live windows
    # And over the whole run, as scraped independently by this test.
    before, after = Snapshot.from_text(stack["before"]), Snapshot.from_text(stack["after"])
    served = after.total("hipfire:generation_tokens_total") - before.total(
        "hipfire:generation_tokens_total"
    )
    assert served == sum(r["num_output_tokens"] for r in runs)


def test_live_server_exports_every_metric_the_deploy_files_use(stack):
    from tests.deploy.deploy_files import all_referenced_metrics

    assert all_referenced_metrics() - exported_families(stack["after"]) == set()


def test_every_promql_expression_evaluates(stack):
    exprs = dashboard_exprs() + rule_exprs() + [("variable", q) for q in variable_queries()]
    exprs += [(r["record"], r["record"]) for r in rules() if "record" in r]
    errors = []
    for name, expr in exprs:
        answer = query(stack["prom"], expr)
        if answer["status"] != "success":
            errors.append(f"{name}: {answer.get('error')}\n  {expr}")
    assert not errors, "\n".join(errors)


def test_throughput_latency_and_slot_panels_return_data(stack):
    empty = []
    for title, expr in dashboard_exprs():
        if title not in PANELS_WITH_DATA:
            continue
        result = query(stack["prom"], expr)["data"]["result"]
        values = [float(s["value"][1]) for s in result]
        if not values or all(math.isnan(v) for v in values):
            empty.append(f"{title}: {expr}")
    assert not empty, "no data:\n" + "\n".join(empty)
    throughput = query(stack["prom"], "model_name:hipfire_generation_tokens:rate1m")
    assert float(throughput["data"]["result"][0]["value"][1]) > 0
    capacity = query(stack["prom"], "sum(hipfire:slot_capacity)")
    assert float(capacity["data"]["result"][0]["value"][1]) == 8
