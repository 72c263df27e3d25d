"""`hipfire-bench quant-linear` without a GPU: its candidate grid, the choice of the best single
tile over the points, the Markdown report, and the one-line refusals."""

from __future__ import annotations

import subprocess
import sys

from loadtests.lab.kernels.quant_linear import best_tiles, candidates, markdown
from loadtests.lab.peer.children import ROOT


def test_candidates_take_the_rule_split_and_its_neighbours():
    cands = candidates("fp8", 6144, 4096, 1, 132)
    rule = [c for c in cands if c[2]]
    assert rule and all(c[1] >= 1 for c in cands)
    assert any(not tile[4] for tile, _, _ in cands)  # multiply-add tiles at one row
    assert all(tile[4] for tile, _, _ in candidates("fp8", 6144, 4096, 16, 132))
    assert all(4096 // split >= tile[1] for tile, split, _ in cands)  # >= one K tile per split


def _variant(tile, us, rule=True, ok=True):
    return {"variant": str(tile), "tile": list(tile), "rule_split": rule, "us": us, "ok": ok}


def test_best_tile_needs_every_point_and_sums_rule_splits():
    a, b = (64, 128, 4, 3, True), (32, 128, 4, 2, False)
    points = [
        {"format": "fp8", "best": {"us": 9.0},
         "variants": [_variant(a, 10.0), _variant(b, 9.0), _variant(a, 1.0, rule=False)]},
        {"format": "fp8", "best": {"us": 12.0},
         "variants": [_variant(a, 12.0), _variant(b, 30.0, ok=False)]},
    ]  # fmt: skip
    # b is the faster at the first point, but has no good timing at the second
    assert best_tiles(points) == {"fp8": {"tile": list(a), "sum_us": 22.0, "sum_best_us": 21.0}}


def test_markdown_has_a_row_per_point():
    point = {"format": "fp8", "shape": "qkv", "rows": 1, "best": {"variant": "t", "us": 10.0},
             "best_tbps": 2.5, "w8a8_scaled_mm_us": 20.0, "variants": []}  # fmt: skip
    record = {"device": "GPU", "date": "d", "torch": "t", "triton": "x", "copy_bw_tbps": 4.0,
              "wall_s": 1.0, "bf16": [{"shape": "qkv", "rows": 1, "us": 15.0}],
              "points": [point], "best_tiles": {}}  # fmt: skip
    text = markdown(record)
    assert "| fp8 | qkv | 1 | 15.0 | t | 10.0 | 1.50x | 2.5 | 0.62 | 20.0 |" in text


def test_bad_arguments_are_one_line_errors():
    cmd = [sys.executable, "-m", "loadtests.lab.cli", "quant-linear", "--out", "x"]
    for extra in (["--rows", "0"], ["--shapes", "lm_head"], ["--formats", "int3"]):
        proc = subprocess.run(cmd + extra, cwd=ROOT, capture_output=True, text=True, timeout=60)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith("hipfire-bench quant-linear:"), last
        assert extra[0] in last
