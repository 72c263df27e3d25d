"""The context probe on tiny random models on the CPU: uniform, ragged and longest-uniform
batches of proposals and target rounds and their mean-context interpolation (bad input:
test_probes.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadtests.context_probe import main, mean_based, ragged_lengths


def test_mean_based_interpolates_the_uniform_timings():
    assert mean_based(10.0, 20.0, 1000, 1500, 1250.0) == pytest.approx(15.0)
    assert mean_based(10.0, 20.0, 1000, 1500, 900.0) == pytest.approx(8.0)
    assert mean_based(10.0, 99.0, 1000, 1000, 1000.0) == 10.0  # (no spread: no slope)
    lens = ragged_lengths(200, 64, np.random.default_rng(0))
    assert min(lens) >= 32 and max(lens) <= 96 and len(lens) == 200


def test_the_probe_times_the_three_batches_on_tiny_models(tmp_path, capsys):
    argv = [
        "--out", str(tmp_path), "--model", "random:tiny", "--draft", "random:tiny",
        "--device", "cpu", "--dtype", "float32", "--context", "32", "--draft-counts", "2",
        "--drafts", "2", "--rounds", "2x2,3x1", "--repeats", "1", "--kv-cache-memory", "64MiB",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "context_probe.json").read_text())
    assert report["device"] == "cpu" and report["context"] == 32
    rows = report["rows"]
    assert [(r["kind"], r["shape"]) for r in rows] == [
        ("propose", "2 x 2 drafts"),
        ("round forward", "2 x 2 rows"),
        ("round forward", "3 x 1 rows"),
    ]
    for r in rows:
        assert 16 <= r["ragged_mean"] <= r["ragged_max"] <= 48
        assert min(r["uniform_ms"], r["ragged_ms"], r["uniform_max_ms"]) > 0
        expect = mean_based(
            r["uniform_ms"], r["uniform_max_ms"], 32, r["ragged_max"], r["ragged_mean"]
        )
        # (the report rounds the mean to 0.1 token and the times to 1e-4 ms)
        spread = max(r["ragged_max"] - 32, 1)
        slope = abs(r["uniform_max_ms"] - r["uniform_ms"]) / spread
        assert r["mean_based_ms"] == pytest.approx(expect, abs=0.05 * slope + 1e-3)
    assert "round forward" in capsys.readouterr().out
