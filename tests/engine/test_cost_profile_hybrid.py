"""A hybrid target's cost profile: KV bytes of its full-attention layers only, and the bytes its
recurrent state and journal move per round."""

from __future__ import annotations

import json

from executor.random_model import PRESETS
from executor.recurrent_state import RecurrentStates
from hipfire_serve.cli import main as cli_main
from hipfire_serve.cost_profile.hybrid import recurrent_round_bytes, recurrent_section


def test_round_bytes_count_state_once_per_sequence_and_the_journal_per_row():
    cfg = PRESETS["qwen3.5-27b"]
    sec = recurrent_section(cfg, 2)
    state, journal = 153_944_064, 2_565_120
    assert sec["state_bytes_per_seq"] == state and sec["journal_bytes_per_row"] == journal
    assert sec["num_linear_layers"] == 48 and sec["num_kv_layers"] == 16
    assert recurrent_round_bytes(sec, 64) == 64 * 2 * state  # 19.7 GB: AR rounds read+write
    # two groups of 8 rows, 3 and all 7 drafts kept: verify reads the states and writes 16
    # journal rows, the commit reads and writes the states and reads 4 + 8 journal rows
    got = recurrent_round_bytes(sec, 1, [8, 8], [3, 7])
    assert got == 2 * state + 2 * 3 * state + (16 + 4 + 8) * journal
    assert recurrent_round_bytes(sec, 1, [8, 8]) == 2 * state + 2 * 3 * state + 32 * journal
    assert recurrent_round_bytes(None, 64, [8]) == 0  # a dense target moves none


def test_profile_of_a_hybrid_target_carries_its_recurrent_section(tmp_path):
    out = tmp_path / "profile.json"
    args = ["profile", "--model", "random:tiny-qwen3.5", "--device", "cpu", "--dtype", "float32"]
    args += ["--max-concurrency", "2", "--kv-cache-memory", "8MiB", "--rows", "1,2"]
    args += ["--kv-lens", "16,64", "--repeats", "1", "--out", str(out)]
    assert cli_main(args) == 0
    target = json.loads(out.read_text())["target"]
    cfg = PRESETS["tiny-qwen3.5"]
    assert target["kv_bytes_per_token"] == 1 * 2 * 2 * 16 * 4  # one full layer of four
    rec = target["recurrent"]
    assert rec["state_bytes_per_seq"] == RecurrentStates.bytes_per_slot(cfg, 4)
    assert rec["journal_bytes_per_row"] == RecurrentStates.journal_bytes_per_row(cfg, 4)
    assert all(ms > 0 for _, ms in target["rows_ms"])
