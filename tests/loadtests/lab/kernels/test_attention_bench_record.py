"""The committed benchmark record: complete grid, and the tables render from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from kernels import arch
from loadtests.lab.kernels.attention import markdown_tables
from loadtests.lab.kernels.common import BATCHES, CONTEXTS, GQAS, ROWS, set_attention_tiles

RECORD = Path(__file__).resolve().parents[4] / "docs" / "perf" / "kernels.json"


def test_record_covers_the_grid_and_renders():
    record = json.loads(RECORD.read_text())
    shapes = {(r["ctx"], r["batch"], r["rows"], r["gqa"]) for r in record["attention"]}
    assert shapes == {(c, b, r, g) for c in CONTEXTS for b in BATCHES for r in ROWS for g in GQAS}
    assert record["gpu"] and record["date_utc"] and record["copy_tbps"] > 0
    table = markdown_tables(record)
    assert table.count("\n|") >= len(shapes) + len(record["small_kernels"])


def test_record_was_measured_with_the_committed_tiles():
    # The published numbers must describe the table the code ships, not a tuning override.
    record = json.loads(RECORD.read_text())
    shipped = arch.FAMILY_CONFIGS[record["arch_family"]].attention
    assert record["attention_tiles"] == dataclasses.asdict(shipped)
    assert not record.get("tile_changes")


def test_tile_override_edits_one_entry_and_restores():
    cpu = torch.device("cpu")
    before = arch.arch_config(cpu).attention
    set_attention_tiles(cpu, max_block_m=32)
    try:
        assert arch.arch_config(cpu).attention.max_block_m == 32
    finally:
        set_attention_tiles(cpu, **dataclasses.asdict(before))
    assert arch.arch_config(cpu).attention == before
