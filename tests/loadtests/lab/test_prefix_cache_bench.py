"""The prefix-cache benchmark's figures, ratios and record, on made-up loadgen runs."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtests.lab import prefix_cache_bench as bench


def _lat(p50: float, p90: float | None = None) -> dict:
    return {"p50_ms": p50, "p90_ms": p90 or 2 * p50, "p99_ms": 3 * p50}


def _run(scale: float, turns: bool, hits: bool) -> dict:
    run = {
        "ttft": _lat(100 * scale),
        "ttft_split": {"first": {"ttft": _lat(400.0)}, "later": {"ttft": _lat(50 * scale)}},
        "refill_tokens_per_s": 40 / scale,
        "requests_per_s": 2 / scale,
        "num_prompt_tokens": 1000,
        "num_ok": 10,
        "server": {"prefix_cache_counters": True, "prefix_cache_hit_rate": 0.7 if hits else None},
    }
    if turns:
        run["turns"] = {
            str(t): {"ttft": _lat(100.0 * (1 if t == 1 else scale)), "mean_prompt_tokens": 90 * t}
            for t in range(1, 5)
        }
    return run


def test_ratios_and_record(tmp_path):
    reps = []
    for scale in (4.0, 5.0, 6.0):
        reps.append({
            wl: {"on": bench.figures(_run(1.0, wl == "multi-turn", True)),
                 "off": bench.figures(_run(scale, wl == "multi-turn", False))}
            for wl in bench.WORKLOADS
        })  # fmt: skip
    summary = bench.summarize(reps)
    sp, mt = summary["shared-prefix"], summary["multi-turn"]
    assert sp["ttft_off_over_on"]["ttft_later_p50_ms"] == pytest.approx(5.0)  # median scale
    assert sp["ttft_off_over_on"]["ttft_first_p50_ms"] == pytest.approx(1.0)
    assert sp["throughput_on_over_off"]["output_tokens_per_s"] == pytest.approx(5.0)
    assert mt["ttft_off_over_on"]["ttft_turn1_p50_ms"] == pytest.approx(1.0)
    assert mt["ttft_off_over_on"]["ttft_turn3_p50_ms"] == pytest.approx(5.0)
    assert mt["on"]["prompt_tokens_turn4"] == 360
    assert sp["on"]["prefix_cache_hit_rate"] == 0.7 and sp["off"]["prefix_cache_hit_rate"] is None
    args = argparse.Namespace(
        repetitions=3, concurrency=2, max_tokens=16, torch_threads=1, draft="none",
        spec_mode="ar", num_groups=4, system_prompt_len=1024, question_len=32, num_requests=16,
        num_conversations=4, num_turns=4, mt_system_len=512, user_len=64,
    )  # fmt: skip
    record = {"model": "m", "summary": summary, "repetitions": reps}
    bench.write_report(tmp_path, args, record)
    md = (tmp_path / "prefix-cache.md").read_text()
    assert "shared with other work" in md
    assert "| shared-prefix | TTFT later ms | 50.0 | 250.0 | **5.00** |" in md
    assert "| multi-turn | TTFT turn 1 ms | 100.0 | 100.0 | **1.00** |" in md
    assert "| shared-prefix | prefix-cache hit rate | 0.700 | - |  |" in md
    assert json.loads((tmp_path / "prefix-cache.json").read_text())["summary"] == summary


def test_loadgen_arguments_parse():
    from loadtests.cli import build_parser

    args = argparse.Namespace(
        num_groups=2, system_prompt_len=64, question_len=4, num_requests=6, concurrency=2,
        max_tokens=4, num_conversations=2, num_turns=3, mt_system_len=16, user_len=4,
    )  # fmt: skip
    for wl in bench.WORKLOADS:
        parsed = build_parser().parse_args(bench.loadgen_args(args, wl, seed=5))
        assert parsed.command == wl and parsed.seed == 5 and parsed.concurrency == [2]
