"""`hipfire-bench gpu` with a block drafter on the CPU: the engine built for it with a draft
model beside, per-drafter concurrencies, the block drafter's figures and targets, and the graph
warm-up of its blocks."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from loadtests.lab.gpu.block import block_targets, drafting_ms
from loadtests.lab.gpu.config import QUICK, BenchConfig
from loadtests.lab.gpu.main import main
from loadtests.lab.gpu.runs import grid_order

BLOCK = "random-block:tiny-dflash"


def test_drafters_split_into_the_engines_own_and_one_beside():
    cfg = dataclasses.replace(QUICK, drafters=(BLOCK, "random:tiny", "ngram"))
    assert (cfg.block_drafter, cfg.chain_drafter, cfg.model_drafter) == (
        BLOCK,
        "random:tiny",
        BLOCK,
    )
    plain = dataclasses.replace(QUICK, drafters=("random:tiny", "ngram"))
    assert (plain.block_drafter, plain.model_drafter) == ("none", "random:tiny")
    two_blocks = dataclasses.replace(QUICK, drafters=(BLOCK, "random-block:qwen3-8b-dflash"))
    with pytest.raises(ValueError, match="one block drafter"):
        _ = two_blocks.block_drafter
    two_models = dataclasses.replace(QUICK, drafters=("random:tiny", "random:qwen3-0.6b"))
    with pytest.raises(ValueError, match="one draft model"):
        _ = two_models.chain_drafter


def test_drafters_after_the_first_run_at_their_own_concurrencies():
    cfg = dataclasses.replace(
        QUICK,
        drafters=(BLOCK, "ngram"),
        concurrency=(1, 2, 4),
        other_concurrency=(1, 4),
        repeats=1,
    )
    order = grid_order(cfg)
    assert {c for _, _, d, _, c in order if d == BLOCK} == {1, 2, 4}
    assert {c for _, _, d, _, c in order if d == "ngram"} == {1, 4}
    assert {c for _, p, _, _, c in order if p == "all-ar"} == {1, 2, 4}
    assert cfg.concurrency_of("-") == (1, 2, 4)


def _block_section():
    propose = [[k, c, d, 1.0 + 0.1 * k + 0.001 * c] for c in (16, 512) for k in (1, 2, 4)
               for d in (1, 7)]  # fmt: skip
    return {"propose_ms": propose, "context_write_ms": [[1, 0.05], [64, 0.25]]}


def test_drafting_ms_reads_the_proposals_and_the_write():
    ms = drafting_ms(_block_section(), 2, 264.0, 7, 16)
    assert ms["forward_ms"] == pytest.approx(1.0 + 0.2 + 0.264)
    assert ms["write_ms"] == pytest.approx(0.05 + 0.2 * 15 / 63)
    # between profiled request counts: log-linear
    mid = drafting_ms(_block_section(), 3, 16.0, 7, 1)["forward_ms"]
    assert 1.216 < mid < 1.416


def test_block_targets_are_checked_within_the_run():
    point = {"drafter": BLOCK, "cohort": "code", "concurrency": 1, "all-spec": 640.0,
             "all-ar": 200.0, "vs_best": 0.99, "vs_ar": 3.17, "vs_spec": 0.99,
             "crossover": False}  # fmt: skip
    record = {
        "comparisons": [point, {**point, "drafter": "ngram", "vs_best": 0.5}],
        "profile": {"block_drafter": _block_section()},
        "config": {"spec_depth": 8, "prompt_len": 512, "max_tokens": 128},
        "summary": [
            {"policy": "all-spec", "drafter": BLOCK, "cohort": "code", "concurrency": 1,
             "step_ms_full_live": 10.0},
            {"policy": "all-spec", "drafter": BLOCK, "cohort": "code", "concurrency": 32,
             "step_ms_full_live": 10.0},
        ],
    }  # fmt: skip
    t = block_targets(record, BLOCK)
    assert t["spec_vs_ar_c1_code"]["status"] == "met" and t["spec_vs_ar_c1_code"]["worst"] == 3.2
    assert t["adaptive_vs_best"]["worst"] == 0.99  # the other drafter's points do not count
    assert t["adaptive_at_crossover"]["status"] == "not measured"
    (share,) = t["shares"]  # C = 32 is past the bound's range
    assert share["share"] == pytest.approx((share["forward_ms"] + share["write_ms"]) / 10.0)
    assert t["drafting_share"]["status"] == "missed"  # ~1.8 of 10 ms


def test_quick_run_with_a_block_drafter_and_a_draft_model_beside(tmp_path):
    argv = ["--quick", "--out", str(tmp_path), "--repeats", "1", "--sim-seeds", "1"]
    argv += ["--drafters", f"{BLOCK},random:tiny,ngram", "--cohorts", "code"]
    argv += ["--other-cohorts", "code", "--concurrency", "1,2", "--other-concurrency", "2"]
    assert main(argv) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["skipped"] == []
    assert {(r["drafter"], r["concurrency"]) for r in record["runs"] if r["drafter"] != "-"} == {
        (BLOCK, 1),
        (BLOCK, 2),
        ("random:tiny", 2),
        ("ngram", 2),
    }
    for run in record["runs"]:
        assert run["num_failed"] == 0
        assert run["num_tokens"] == run["num_requests"] * record["config"]["max_tokens"]
    profile = record["profile"]
    assert profile["draft_model"]["kind"] == "block" and profile["block_drafter"]["propose_ms"]
    beside = profile["by_drafter"]["random:tiny"]
    assert beside["draft_model"]["rows_ms_per_step"] and beside["spec_round_ratio"]
    assert record["block"]["drafter"] == BLOCK
    assert {s["concurrency"] for s in record["block"]["targets"]["shares"]} == {1, 2}
    assert f"## Block drafter `{BLOCK}`" in (tmp_path / "gpu.md").read_text()


class FakeGraphs:
    max_rows = 2048
    max_blocks_per_seq = 512

    def __init__(self):
        self.graphs = {}

    def width_for(self, num_blocks):
        from executor.graphs import DecodeGraphs

        return DecodeGraphs.width_for(self, num_blocks)

    def capture(self, bucket, width, max_q_len=1):
        self.graphs[(bucket, width, max_q_len)] = None


def test_graph_warm_up_covers_the_block_drafters_blocks():
    from loadtests.lab.gpu.runs import warm_graphs

    block = SimpleNamespace(graphs=FakeGraphs(), block_len=16, extend_context=None)
    engine = SimpleNamespace(
        executor=SimpleNamespace(graphs=FakeGraphs()),
        config=SimpleNamespace(block_size=16),
        drafter=SimpleNamespace(inner=block),
    )
    cfg = dataclasses.replace(BenchConfig(), prompt_len=512)
    warm_graphs(engine, cfg)
    keys = set(block.graphs.graphs)
    assert {q for _, _, q in keys} == {16} and {w for _, w, _ in keys} == {64}
    # 16 rows per request, 1 to 128 requests
    assert min(b for b, _, _ in keys) == 16 and max(b for b, _, _ in keys) == 2048
