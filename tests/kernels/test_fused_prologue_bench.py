"""The fusion probe's parts that need no GPU: arguments, the switch it captures under, the
record and the report it writes (from made-up timings)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import bench_fusion
from kernels import skinny_linear as sl


def test_arguments_default_to_both_models_at_1_4_16_rows(tmp_path):
    args = bench_fusion.parse_args(["--out", str(tmp_path)])
    assert args.models == ("qwen3-8b", "qwen3-0.6b") and args.rows == (1, 4, 16)
    args = bench_fusion.parse_args(["--out", str(tmp_path), "--models", "qwen3-8b", "--rows", "8"])
    assert args.models == ("qwen3-8b",) and args.rows == (8,)


@pytest.mark.parametrize("bad", [["--models", "llama"], ["--rows", "17"], ["--replays", "0"]])
def test_arguments_out_of_range_are_refused(tmp_path, bad):
    with pytest.raises(SystemExit):
        bench_fusion.parse_args(["--out", str(tmp_path), *bad])


def test_the_switch_sets_fusion_counts_fused_launches_and_restores():
    gate_up = torch.randn(2, 64, dtype=torch.float16)  # [2, 2I]
    weight = torch.randn(16, 32, dtype=torch.float16)  # [N, I]
    counter = [0]
    launch = sl.silu_mul_skinny_linear
    with bench_fusion.fusion_as_served(False, counter):
        assert not sl.fused_prologue_enabled()
    with bench_fusion.fusion_as_served(True, counter):
        assert sl.fused_prologue_enabled()
        sl.silu_mul_skinny_linear(gate_up, weight, None, sl.SkinnyConfig(16, 32, 1, 4, 2, True))
    assert counter == [1]
    assert sl.silu_mul_skinny_linear is launch and sl.fused_prologue_enabled()


def _times(off: float, on: float) -> dict:
    return {
        False: {"median_us": off, "min_us": off - 1, "max_us": off + 2},
        True: {"median_us": on, "min_us": on - 1, "max_us": on + 2},
    }


def test_record_and_report_from_made_up_timings(tmp_path):
    records = [
        bench_fusion.record_for("qwen3-8b", 1, _times(4650.0, 4560.0), True, 0.0, 36),
        bench_fusion.record_for("qwen3-0.6b", 16, _times(1200.0, 1230.0), False, 0.5, 28),
    ]
    assert records[0]["ratio"] == round(4560 / 4650, 4) and records[0]["saved_us"] == 90.0
    assert records[1]["saved_us"] == -30.0 and records[1]["fused_launches"] == 28
    meta = {
        "device": "Test GPU", "date": "2026-11-30 04:00 UTC", "torch": "t", "triton": "3.6.0",
        "pdl_capable": True, "fused_max_rows": 16, "context_len": 1024, "replays": 40,
        "rounds": 5, "wall_s": 1.0,
    }  # fmt: skip
    bench_fusion.write_report(tmp_path, meta, records)
    saved = json.loads((tmp_path / "fusion.json").read_text())
    assert saved["device"] == "Test GPU" and saved["records"] == records
    md = (tmp_path / "fusion.md").read_text()
    assert "Test GPU, 2026-11-30 04:00 UTC" in md and "PDL on" in md
    assert "| qwen3-8b | 1 | 4650.0 | 4560.0 | 0.981 | 90.0 | 36 | yes |" in md
    assert "| qwen3-0.6b | 16 | 1200.0 | 1230.0 | 1.025 | -30.0 | 28 | NO |" in md
    bench_fusion.write_report(tmp_path, {**meta, "pdl_capable": False}, records)
    assert "PDL unavailable" in (tmp_path / "fusion.md").read_text()


def test_the_probe_needs_a_gpu_beyond_its_arguments(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU")
    assert bench_fusion.main(["--out", str(tmp_path), "--rows", "1"]) == 2
    assert not (tmp_path / "fusion.json").exists()
