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
    wait_for,
)

CONCURRENCY = (1, 2, 4)
WAVES = 2
MAX_TOKENS = 24
# Panels that must show data right after a load run. The acceptance panels need rounds that
# speculated, which is the policy's choice: they are required only when the server drafted.
PANELS_WITH_DATA = (
    "Output tokens/s", "Live slots", "Throughput (tokens/s)", "TTFT p50 / p99", "ITL p50 / p99",
    "E2E latency p50 / p99", "Live slots vs capacity", "Backlog", "Tokens/s per tenant",
    "Spec requests and rows per round", "Route mix (request-rounds/s)",
    "Predicted vs measured round time", "Round phases (mean)", "Prefix cache hit rate",
)  # fmt: skip
PANELS_WITH_DATA_WHEN_DRAFTED = ("Acceptance length", "Acceptance")


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
        root = server_root
        wait_for(prom_url, 'up{job="hipfire-serve"} == 1', 30)
        # One request first, and a scrape that saw it: the per-request and per-round series
        # then exist before the load, so every rate over the load has a sample on each side.
        model_name = httpx.get(f"{root}/v1/models").json()["data"][0]["id"]
        first = {"model": model_name, "prompt": "hi", "max_tokens": 4}
        httpx.post(f"{root}/v1/completions", json=first, timeout=60).raise_for_status()
        wait_for(prom_url, "hipfire:round_rows_count > 0", 30)
        wait_for(prom_url, "hipfire:time_to_first_token_seconds_count > 0", 30)
        before = httpx.get(f"{root}/metrics").text
        out = work / "loadgen"
        cmd = [
            *console_script("hipfire-loadgen", "loadtests.cli"),
            "refill", "--base-url", f"{root}/v1",
            "--concurrency", ",".join(map(str, CONCURRENCY)), "--waves", str(WAVES),
            "--max-tokens", str(MAX_TOKENS), "--cohort", "mixed", "--out", str(out),
            "--label", "live", "--no-progress",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        after = httpx.get(f"{root}/metrics").text
        # A scrape after the load, then rule evaluations over it; every query below is
        # evaluated at this instant, however long the tests take.
        total = Snapshot.from_text(after).total("hipfire:generation_tokens_total")
        wait_for(prom_url, f"sum(hipfire:generation_tokens_total) >= {total}", 30)
        time.sleep(1.5)
        yield {
            "prom": prom_url, "at": time.time(), "loadgen": done, "out": out,
            "before": before, "after": after,
        }  # fmt: skip
    finally:
        stop(prom)
        stop(server)


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
        answer = query(stack["prom"], expr, stack["at"])
        if answer["status"] != "success":
            errors.append(f"{name}: {answer.get('error')}\n  {expr}")
    assert not errors, "\n".join(errors)


def test_speculation_figures_when_the_server_drafted(stack):
    report = json.loads((stack["out"] / "live.json").read_text())
    for run in report["runs"]:
        server = run["server"]
        if server["spec_drafts"] == 0:
            assert server["acceptance_length"] is None
            continue
        assert 1.0 <= server["acceptance_length"] <= 8.0
        assert 0.0 <= server["acceptance_rate"] <= 1.0
        assert server["route_mix"]["spec"] > 0
        assert server["spec_requests_per_round"] > 0


def _values(stack, expr: str) -> list[float]:
    answer = query(stack["prom"], expr, stack["at"])
    assert answer["status"] == "success", answer
    return [float(s["value"][1]) for s in answer["data"]["result"]]


def test_throughput_latency_and_slot_panels_return_data(stack):
    required = PANELS_WITH_DATA
    # Acceptance needs drafts that Prometheus saw happen; whether rounds speculate is the
    # policy's choice, so those panels are required only then.
    if any(
        v > 0 for v in _values(stack, "sum(increase(hipfire:spec_decode_num_drafts_total[1m]))")
    ):
        required += PANELS_WITH_DATA_WHEN_DRAFTED
    empty = []
    for title, expr in dashboard_exprs():
        if title in required:
            values = _values(stack, expr)
            if not values or all(math.isnan(v) for v in values):
                empty.append(f"{title}: {expr}")
    assert not empty, "no data:\n" + "\n".join(empty)
    assert _values(stack, "model_name:hipfire_generation_tokens:rate1m")[0] > 0
    assert _values(stack, "sum(hipfire:slot_capacity)") == [8.0]
    assert 0 <= _values(stack, "model_name:hipfire_prefix_cache_hit_rate:ratio_rate5m")[0] <= 1
