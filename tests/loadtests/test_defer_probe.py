"""The deferred-drafts probe on tiny random models on the CPU: both modes run at every
concurrency and repeat, and the waited mode really resolves its proposals before they return
(bad input: test_probes.py)."""

from __future__ import annotations

import json

from executor.drafters.draft_model import DraftModelDrafter
from loadtests.defer_probe import main, summary


def test_summary_is_deferred_over_waited_per_concurrency():
    runs = [
        {"concurrency": 4, "mode": "deferred", "step_ms": 9.0},
        {"concurrency": 4, "mode": "waited", "step_ms": 10.0},
        {"concurrency": 4, "mode": "deferred", "step_ms": 11.0},
        {"concurrency": 4, "mode": "waited", "step_ms": 10.0},
        {"concurrency": 8, "mode": "deferred", "step_ms": 5.0},  # (no waited run: left out)
    ]
    assert summary(runs) == [
        {
            "concurrency": 4,
            "deferred_step_ms": 10.0,
            "waited_step_ms": 10.0,
            "ratio": 1.0,
            "repeats": 2,
        }
    ]


def test_the_probe_runs_both_modes_on_tiny_models(tmp_path, capsys, monkeypatch):
    asked = {True: 0, False: 0}  # proposals by the defer asked
    unresolved = {True: 0, False: 0}  # of them, returned unresolved
    propose = DraftModelDrafter.propose

    def counted(self, requests, greedy, defer=False):
        batch = propose(self, requests, greedy, defer)
        asked[defer] += 1
        unresolved[defer] += batch.tokens is None
        return batch

    monkeypatch.setattr(DraftModelDrafter, "propose", counted)
    argv = [
        "--out", str(tmp_path), "--model", "random:tiny", "--draft", "random:tiny",
        "--device", "cpu", "--dtype", "float32", "--concurrency", "1,3", "--context", "24",
        "--spec-depth", "3", "--steps", "2", "--repeats", "2", "--kv-cache-memory", "64MiB",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "defer_probe.json").read_text())
    assert report["device"] == "cpu" and report["context"] == 24
    runs = report["runs"]
    assert sorted((r["repeat"], r["concurrency"], r["mode"]) for r in runs) == [
        (rep, c, m) for rep in (0, 1) for c in (1, 3) for m in ("deferred", "waited")
    ]
    # the second repeat runs the modes in the other order
    assert [r["mode"] for r in runs if r["repeat"] == 1][:2] == ["waited", "deferred"]
    assert all(r["steps"] == 2 and r["step_ms"] > 0 and "forward" in r["phase_ms"] for r in runs)
    assert [s["concurrency"] for s in report["summary"]] == [1, 3]
    # deferred runs left their proposals unresolved; waited runs asked for resolved ones
    assert unresolved[True] == asked[True] > 0 and asked[False] > 0
    assert "deferred / waited" in capsys.readouterr().out
