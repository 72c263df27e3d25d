"""The load generator end to end over HTTP, against the in-test fake OpenAI server."""

from __future__ import annotations

import json

import pytest

from loadtests.cli import main
from loadtests.prompts import COHORTS, load_cohort, load_prompts_file
from loadtests.results import load_report
from tests.loadtests.fake_openai import FakeServer, FakeState

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_refill_writes_reports_and_counts_match_server(tmp_path):
    state = FakeState(tokens_per_chunk=3, chunk_delay_s=0.005, valid_keys=("ka", "kb"))
    with FakeServer(state) as srv:
        rc = main([
            "refill", "--base-url", srv.base_url, "--concurrency", "1,2,4", "--waves", "2",
            "--max-tokens", "24", "--cohort", "code", "--api-key", "alice=ka",
            "--api-key", "bob=kb", "--slo", "ttft:2000,tpot:1000", "--out", str(tmp_path),
            "--label", "fake", "--no-progress",
        ])  # fmt: skip
    assert rc == 0
    report = load_report(tmp_path / "fake.json")
    assert report["model"] == "fake-model"
    assert [r["concurrency"] for r in report["runs"]] == [1, 2, 4]
    for run in report["runs"]:
        c = run["concurrency"]
        assert run["num_requests"] == run["num_ok"] == 2 * c
        assert run["num_output_tokens"] == 2 * c * 24
        assert run["token_count_source"] == "token_ids"
        # The server's own counters saw exactly the tokens and requests the client counted.
        assert run["server"]["generation_tokens"] == run["num_output_tokens"]
        assert run["server"]["requests_succeeded"] == run["num_ok"]
        assert run["full_live_tokens_per_s"] > 0
        assert run["full_live_tokens"] <= run["num_output_tokens"]
        assert run["goodput"]["num_good"] == run["num_ok"]
        assert set(run["tenants"]) == {"alice", "bob"}
        assert run["tenants"]["alice"]["num_requests"] == c
        assert 0.5 <= run["fairness"] <= 1.0
        assert run["ttft"]["n"] == 2 * c and run["itl"]["p50_ms"] is not None
    # Requests alternate between the two keys, and every body asks for reproducible counts.
    assert state.keys_seen[:4] == ["ka", "kb", "ka", "kb"]
    assert all(b["ignore_eos"] and b["max_tokens"] == 24 and b["stream"] for b in state.bodies)
    # The same seed gives every run the same prompt order: C=2 starts with C=1's prompts.
    prompts = [b["prompt"] for b in state.bodies]
    assert prompts[2:4] == prompts[0:2]
    assert [b["seed"] for b in state.bodies[:2]] == [0, 1]
    rows = (tmp_path / "fake.csv").read_text().splitlines()
    assert rows[0].startswith("label,mode,concurrency") and len(rows) == 4
    assert len((tmp_path / "fake-requests.csv").read_text().splitlines()) == 1 + 2 + 4 + 8
    for kind in ("throughput", "latency", "timeline"):
        assert (tmp_path / f"fake-{kind}.png").read_bytes()[:8] == PNG_MAGIC


def test_chat_without_token_ids_spreads_usage_over_chunks(tmp_path):
    state = FakeState(tokens_per_chunk=4, send_token_ids=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "hello there"}]})
        + "\n"
        + json.dumps({"id": "b", "prompt": "write a haiku about latency"})
        + "\n"
    )
    with FakeServer(state) as srv:
        rc = main([
            "sweep", "--base-url", srv.base_url, "--rates", "50,inf", "--num-requests", "6",
            "--endpoint", "chat",
            "--prompts", str(prompts), "--max-tokens", "9", "--out", str(tmp_path),
            "--no-plots", "--no-progress", "--metrics-url", "none",
        ])  # fmt: skip
    assert rc == 0
    report = load_report(tmp_path / "poisson-p.json")
    assert [r["rate"] for r in report["runs"]] == [50.0, None]
    for run in report["runs"]:
        assert run["num_output_tokens"] == 6 * 9
        assert run["token_count_source"] == "usage"
        assert run["full_live_tokens_per_s"] is None  # defined for refill runs only
        assert run["server"] is None
    assert state.bodies[0]["messages"][0]["role"] == "user"
    assert not (tmp_path / "poisson-p-throughput.png").exists()


def test_failed_requests_are_reported_and_exit_nonzero(tmp_path, capsys):
    state = FakeState(valid_keys=("right",))
    with FakeServer(state) as srv:
        rc = main([
            "refill", "--base-url", srv.base_url, "--model", "fake-model", "--concurrency", "2",
            "--waves", "1", "--api-key", "wrong", "--out", str(tmp_path), "--label", "bad",
            "--no-plots", "--no-progress",
        ])  # fmt: skip
    assert rc == 1
    run = load_report(tmp_path / "bad.json")["runs"][0]
    assert run["num_errors"] == 2 and run["num_ok"] == 0
    assert "HTTP 401" in run["errors"][0]
    assert "HTTP 401" in capsys.readouterr().err


def test_in_stream_error_fails_only_that_request(tmp_path):
    with FakeServer(FakeState(error_after_chunks=1)) as srv:
        rc = main([
            "poisson", "--base-url", srv.base_url, "--rate", "inf", "--num-requests", "3",
            "--max-tokens", "9", "--out", str(tmp_path), "--label", "err", "--no-plots",
            "--no-progress",
        ])  # fmt: skip
    assert rc == 1
    run = load_report(tmp_path / "err.json")["runs"][0]
    assert (run["num_requests"], run["num_errors"]) == (3, 3)
    assert run["errors"] == ["3x stream error: engine failed"]
    assert run["num_output_tokens"] == 0


def test_compare_prints_ratios_and_plots(tmp_path, capsys):
    with FakeServer(FakeState(chunk_delay_s=0.001)) as fast:
        assert main(["refill", "--base-url", fast.base_url, "--concurrency", "1,2",
                     "--waves", "1", "--max-tokens", "6", "--out", str(tmp_path),
                     "--label", "fast", "--no-plots", "--no-progress"]) == 0  # fmt: skip
    with FakeServer(FakeState(chunk_delay_s=0.02, tokens_per_chunk=1)) as slow:
        assert main(["refill", "--base-url", slow.base_url, "--concurrency", "1,2",
                     "--waves", "1", "--max-tokens", "6", "--out", str(tmp_path),
                     "--label", "slow", "--no-plots", "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    plot = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "fast.json"), str(tmp_path / "slow.json"),
                 "--plot", str(plot)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "slow/fast" in out
    line = next(ln for ln in out.splitlines() if "C=2" in ln and "refill tok/s" in ln)
    ratio = float(line.split()[-1].lstrip("x"))
    assert ratio < 0.8  # the slow server is clearly slower
    assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("name", COHORTS)
def test_shipped_cohorts(name):
    prompts = load_cohort(name)
    assert len(prompts) >= 30
    assert len({p.prompt for p in prompts}) == len(prompts)
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    lengths = sorted(len(p.prompt) for p in prompts)
    assert lengths[-1] >= 5 * lengths[0]  # varied: short asks and long passages


def test_bad_arguments_exit_2(capsys):
    assert main(["refill", "--waves", "0", "--metrics-url", "none"]) == 2
    assert "--waves must be >= 1" in capsys.readouterr().err
    assert main(["poisson", "--slo", "ttft", "--metrics-url", "none"]) == 2
    assert "bad SLO" in capsys.readouterr().err


def test_bad_prompts_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_prompts_file(bad)
