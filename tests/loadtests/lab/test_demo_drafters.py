"""`hipfire-bench demo-drafters`: the greedy check, acceptance and ratios on made-up figures,
and short runs on the demo target with a tiny block drafter (CPU): the report's fields, and a
corrupted output failing the run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from executor.model_config import load_model_config
from hipfire_serve.demo import demo_model_dir
from loadtests.lab import demo_drafters
from loadtests.lab.demo_drafters import Point, acceptance, add_ratios, greedy_mismatches
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter


def test_greedy_mismatches_flags_every_difference():
    reference = {("code", 0): [5, 6, 7], ("code", 1): [1, 2], ("prose", 0): [9]}
    outputs = {
        ("code", 0): [5, 6, 7],  # equal
        ("code", 1): [1, 3],  # differs at 1
        ("prose", 0): [],  # a prefix of the reference: differs where it ends
        ("prose", 4): [4],  # no reference: skipped
    }
    compared, bad = greedy_mismatches(reference, outputs, "ngram/spec")
    assert compared == 3
    assert bad == [
        {"run": "ngram/spec", "key": ["code", 1], "first_diff": 1},
        {"run": "ngram/spec", "key": ["prose", 0], "first_diff": 0},
    ]
    assert greedy_mismatches(reference, {("code", 0): [5, 6, 7]}, "x") == (1, [])


def _round(num_spec, num_ar, drafted, accepted):
    return SimpleNamespace(
        num_spec=num_spec, num_ar=num_ar, drafted_per_pos=drafted, accepted_per_pos=accepted
    )


def test_acceptance_length_is_accepted_drafts_plus_one_per_speculating_request_round():
    # two spec requests drafting 3 (one accepts 2, one 0), then one spec request accepting 1 of 2
    rounds = [
        _round(2, 1, [2, 2, 2], [1, 1, 0]),
        _round(1, 0, [1, 1], [1, 0]),
        _round(0, 3, [], []),
    ]
    a = acceptance(rounds)
    assert a["spec_request_rounds"] == 3 and a["decode_request_rounds"] == 7
    assert a["num_drafted"] == 8 and a["num_accepted"] == 3
    assert a["acceptance_len"] == pytest.approx(6 / 3)
    assert acceptance([_round(0, 4, [], [])])["acceptance_len"] is None


def _point(drafter, mode, tokens_per_s, acceptance_len, kind="code"):
    counts = dict.fromkeys(
        ("num_rounds", "spec_request_rounds", "decode_request_rounds", "num_drafted"), 1
    )
    return Point(
        drafter=drafter,
        mode=mode,
        concurrency=1,
        kind=kind,
        seconds=1.0,
        output_tokens=int(tokens_per_s),
        tokens_per_s=tokens_per_s,
        num_accepted=1,
        acceptance_len=acceptance_len,
        finished_requests=1,
        **counts,
    )


def test_ratios_are_to_ar_and_to_the_chain_of_the_same_mode():
    points = [
        _point("none", "ar", 100.0, None),
        _point("draft-model", "spec", 150.0, 2.0),
        _point("draft-model", "adaptive", 120.0, 4.0),
        _point("block", "spec", 250.0, 3.0),
        _point("block", "adaptive", 200.0, 2.0),
        _point("block", "spec", 80.0, 1.5, kind="prose"),  # no AR, no chain of its kind
    ]
    add_ratios(points)
    assert [p.over_ar_tokens_per_s for p in points] == [1.0, 1.5, 1.2, 2.5, 2.0, None]
    assert [p.over_chain_acceptance_len for p in points] == [None, 1.0, 1.0, 1.5, 0.5, None]


# -- short runs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    target = load_model_config(demo_model_dir())
    return make_tiny_block_drafter(
        tmp_path_factory.mktemp("block"),
        target,
        seed=3,
        dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 3, 5]},
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A corpus folder as the demo's: val token streams (a repeated phrase inside random text,
    no document ends) and the manifest's special tokens."""
    path = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for kind in ("code", "prose"):
        stream = np.tile(rng.integers(3, 8192, size=40), 20)
        np.save(path / f"{kind}_val.npy", stream.astype(np.uint16))
    manifest = {"special_token_ids": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _argv(data_dir, out, drafters, block_dir=None):
    argv = ["--data", str(data_dir), "--drafters", drafters, "--modes", "spec"]
    argv += ["--concurrency", "1,2", "--seconds", "0.2", "--prompt-len", "16"]
    argv += ["--max-tokens", "8", "--num-prompts", "3", "--kv-cache-memory", "64MiB"]
    argv += ["--out", str(out)]
    return argv + (["--block", str(block_dir)] if block_dir else [])


def test_a_short_run_reports_every_point(tmp_path, data_dir, block_dir):
    argv = _argv(data_dir, tmp_path, "none,draft-model,block-rerank", block_dir)
    assert demo_drafters.main(argv) == 0
    record = json.loads((tmp_path / "block-drafting-demo.json").read_text())
    assert record["benchmark"] == "demo_drafters" and record["date"]
    assert record["machine"]["torch"] and record["machine"]["name"].startswith("CPU")
    assert record["settings"]["dtype"] == "float32"
    assert [d["name"] for d in record["drafters"]] == ["none", "draft-model", "block-rerank"]
    rerank = record["drafters"][2]
    assert rerank["spec_depth"] == 4 and rerank["reranker"]["spec"]["rows_reranked"] > 0
    points = record["points"]
    expected = [
        (d, m, c, k)
        for d, m in (("none", "ar"), ("draft-model", "spec"), ("block-rerank", "spec"))
        for c in (1, 2)
        for k in ("code", "prose")
    ]
    assert [(p["drafter"], p["mode"], p["concurrency"], p["kind"]) for p in points] == expected
    for p in points:
        assert p["output_tokens"] > 0 and p["tokens_per_s"] > 0 and p["over_ar_tokens_per_s"] > 0
        if p["drafter"] == "none":
            assert p["over_ar_tokens_per_s"] == 1.0 and p["acceptance_len"] is None
        else:
            assert p["acceptance_len"] >= 1.0 and p["over_chain_acceptance_len"] > 0
    check = record["greedy_check"]
    assert check["ok"] and check["mismatches"] == []
    assert check["compared"] >= 2 * 2 * (1 + 2)  # every drafter's warm-up wave at least
    md = (tmp_path / "block-drafting-demo.md").read_text()
    assert "| drafter | mode | C | kind |" in md and "block-rerank" in md


def test_a_corrupted_output_fails_the_run(tmp_path, data_dir, monkeypatch):
    real = demo_drafters.run_point

    def corrupting(engine, *args, **kwargs):
        figures, finished = real(engine, *args, **kwargs)
        if engine.drafter is not None:  # a speculating engine's first output changed
            first = min(finished)
            finished[first] = [finished[first][0] + 1, *finished[first][1:]]
        return figures, finished

    monkeypatch.setattr(demo_drafters, "run_point", corrupting)
    assert demo_drafters.main(_argv(data_dir, tmp_path, "none,ngram")) == 1
    check = json.loads((tmp_path / "block-drafting-demo.json").read_text())["greedy_check"]
    assert not check["ok"]
    assert {m["run"] for m in check["mismatches"]} == {"ngram/spec/C=1", "ngram/spec/C=2"}
    assert all(m["first_diff"] == 0 for m in check["mismatches"])
    assert "differ from AR's" in (tmp_path / "block-drafting-demo.md").read_text()
