"""The PDL probe's parts that need no GPU: arguments, the decode batch it replays, the record
and the report it writes (from made-up timings)."""

from __future__ import annotations

import json

import pytest
import torch

from loadtests.lab.kernels import pdl as bench_pdl


def test_arguments_default_to_both_models_at_1_4_16_rows(tmp_path):
    args = bench_pdl.parse_args(["--out", str(tmp_path)])
    assert args.models == ("qwen3-8b", "qwen3-0.6b")
    assert args.rows == (1, 4, 16)
    assert args.context == 1024
    args = bench_pdl.parse_args(["--out", str(tmp_path), "--models", "qwen3-0.6b", "--rows", "2"])
    assert args.models == ("qwen3-0.6b",) and args.rows == (2,)


@pytest.mark.parametrize(
    "bad", [["--models", "llama"], ["--rows", "17"], ["--rows", "0"], ["--rounds", "0"]]
)
def test_arguments_out_of_range_are_refused(tmp_path, bad):
    with pytest.raises(SystemExit):
        bench_pdl.parse_args(["--out", str(tmp_path), *bad])


@pytest.mark.parametrize(("num_seqs", "q_len"), [(1, 1), (4, 1), (4, 4), (16, 1)])
def test_decode_batch_puts_each_row_in_its_own_sequence_pages(num_seqs, q_len):
    context, page = 1024, 16
    batch = bench_pdl.decode_batch(num_seqs, q_len, context, 1000, torch.device("cpu"))
    rows = num_seqs * q_len
    assert batch.num_rows == rows and batch.q_len == q_len
    assert batch.cu_q_lens.tolist() == [s * q_len for s in range(num_seqs + 1)]
    assert batch.seq_lens.tolist() == [context + q_len] * num_seqs
    width = bench_pdl.blocks_per_seq(context, q_len)
    assert batch.block_tables.shape == (num_seqs, width)
    for row in range(rows):
        seq, j = divmod(row, q_len)
        pos = int(batch.positions[row])
        assert pos == context + j
        slot = int(batch.slot_mapping[row])
        assert slot // page == int(batch.block_tables[seq, pos // page])
        assert slot % page == pos % page
    assert len(set(batch.slot_mapping.tolist())) == rows
    assert ((batch.input_ids >= 0) & (batch.input_ids < 1000)).all()


def _times(off: float, on: float) -> dict:
    return {
        False: {"median_us": off, "min_us": off - 1, "max_us": off + 2},
        True: {"median_us": on, "min_us": on - 1, "max_us": on + 2},
    }


def test_record_and_report_from_made_up_timings(tmp_path):
    records = [
        bench_pdl.record_for("qwen3-8b", 1, _times(4790.0, 4600.0), True, 0.0),
        bench_pdl.record_for("qwen3-0.6b", 16, _times(1200.0, 1260.0), False, 0.25),
    ]
    assert records[0]["ratio"] == round(4600 / 4790, 4)
    assert records[0]["saved_us"] == 190.0
    assert records[1]["saved_us"] == -60.0
    assert records[0]["off_range_us"] == [4789.0, 4792.0]
    meta = {
        "device": "Test GPU", "date": "2026-11-30 03:00 UTC", "torch": "t", "triton": "3.6.0",
        "pdl_capable": True, "context_len": 1024, "replays": 50, "rounds": 7, "wall_s": 1.0,
    }  # fmt: skip
    bench_pdl.write_report(tmp_path, meta, records)
    saved = json.loads((tmp_path / "pdl.json").read_text())
    assert saved["device"] == "Test GPU" and saved["records"] == records
    md = (tmp_path / "pdl.md").read_text()
    assert "Test GPU, 2026-11-30 03:00 UTC" in md
    assert "| qwen3-8b | 1 | 4790.0 | 4600.0 | 0.960 | 190.0 | yes |" in md
    assert "| qwen3-0.6b | 16 | 1200.0 | 1260.0 | 1.050 | -60.0 | NO |" in md
    assert "both graphs are PDL-off" not in md
    bench_pdl.write_report(tmp_path, {**meta, "pdl_capable": False}, records)
    assert "both graphs are PDL-off" in (tmp_path / "pdl.md").read_text()


def test_the_probe_needs_a_gpu_beyond_its_arguments(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("runs for real on a GPU")
    assert bench_pdl.main(["--out", str(tmp_path), "--models", "qwen3-0.6b", "--rows", "1"]) == 2
    assert not (tmp_path / "pdl.json").exists()


def test_the_decode_batch_drives_a_forward_that_writes_its_rows_kv():
    from executor.model import AttnMetadata
    from executor.random_model import random_model

    cpu = torch.device("cpu")
    model = random_model("tiny", device=cpu, dtype=torch.float32, ops_backend="torch")
    batch = bench_pdl.decode_batch(4, 2, 40, model.config.vocab_size, cpu)
    kv = bench_pdl.random_caches(model, 4 * bench_pdl.blocks_per_seq(40, 2))
    slots = batch.slot_mapping
    before = kv.k[0].view(-1, *kv.k[0].shape[2:])[slots].clone()
    meta = AttnMetadata(
        batch.positions, slots, batch.cu_q_lens, batch.seq_lens, batch.block_tables, batch.q_len
    )
    logits = model.logits(model.forward(batch.input_ids, meta, kv.k, kv.v))
    assert logits.shape == (8, model.config.vocab_size) and logits.isfinite().all()
    after = kv.k[0].view(-1, *kv.k[0].shape[2:])[slots]
    assert not torch.equal(before, after)
