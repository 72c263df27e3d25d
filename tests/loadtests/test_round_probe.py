"""The round probe on the tiny CPU model: plan building, the measurements and the JSON, so the
GPU script cannot rot unnoticed. Timings on a CPU mean nothing; shapes and bookkeeping do."""

from __future__ import annotations

import json

import pytest

from loadtests import round_probe as rp

TINY = [
    "--model",
    "random:tiny",
    "--draft",
    "random:tiny",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "32MiB",
]


def test_main_writes_every_part_of_the_record(tmp_path):
    argv = [
        *TINY,
        "--out",
        str(tmp_path),
        "--chunks",
        "16,32",
        "--contexts",
        "0,8",
        "--decode-rows",
        "3",
        "--decode-kv-len",
        "20",
        "--repeats",
        "2",
        "--seq-scan",
        "2,4",
        "--draft-reqs",
        "1,2",
        "--draft-contexts",
        "8,24",
        "--draft-depth",
        "4",
        "--draft-repeats",
        "2",
        "--replay-reqs",
        "3",
        "--replay-prompts",
        "20,40",
        "--replay-max-tokens",
        "4",
    ]
    assert rp.main(argv) == 0
    record = json.loads((tmp_path / "round_probe.json").read_text())
    rounds = record["rounds"]
    # chunks x contexts, alone and with the decode rows
    assert len(rounds) == 2 * 2 * 2
    shapes = {
        (r["shape"]["chunk"], r["shape"]["context"], r["shape"]["num_decode"]) for r in rounds
    }
    assert shapes == {(c, x, n) for c in (16, 32) for x in (0, 8) for n in (0, 3)}
    for r in rounds:
        s = r["shape"]
        assert r["num_rows"] == s["chunk"] + s["num_decode"]
        assert r["num_kv_tokens"] == s["context"] + s["chunk"] + s["num_decode"] * 20
        assert r["calls"] == 2 and r["first"]["wall_ms"] > 0 and r["median_rest"]["wall_ms"] > 0
        assert r["median_rest"]["forward_ms"] > 0
        pred = r["prediction"]
        assert pred["predicted_ms"] == pytest.approx(pred["dense_ms"] + pred["kv_ms"], abs=2e-3)
        assert r["floor"] is None  # no ceilings on a CPU
    assert [r["shape"]["num_decode"] for r in record["seq_scan"]] == [2, 4]
    assert all(r["shape"]["chunk"] == 32 and r["shape"]["context"] == 8 for r in record["seq_scan"])
    assert record["kernel_table"]["top"]
    drafts = record["drafts"]
    assert [(d["num_reqs"], d["context_len"]) for d in drafts] == [(1, 8), (2, 8), (1, 24), (2, 24)]
    for d in drafts:
        assert d["chain_steps"] == 3
        assert d["wall_ms"] > 0 and d["device_chain_step_ms"] > 0
        assert d["graphs_captured_in_measured"] is None  # no graphs on a CPU
        assert d["profile_chain_ms"] == pytest.approx(3 * d["profile_step_ms"], abs=2e-3)
    replay = record["replay"]
    steps = replay["steps"]
    finished = [r for st in steps for r in st["rounds"]]
    # every request's 4 tokens: the first from its last prefill chunk, 3 from decode rounds
    assert sum(int(r["route"].split()[1][1:]) for r in finished) == 3 * 3
    assert replay["prefill_rounds"] >= 1 and replay["decode_rounds"] >= 3
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in finished)
    assert record["skipped"] == []
    assert record["compile_method"] != "none"
    assert record["compiles_total"] == 0  # the CPU path runs no Triton kernels


@pytest.fixture(scope="module")
def engine():
    args = rp.argparse.Namespace(
        model="random:tiny",
        draft="random:tiny",
        device="cpu",
        dtype="float32",
        decode_rows=4,
        seq_scan="",
        draft_depth=4,
        kv_cache_memory="32MiB",
        max_model_len=256,
        profile="",
    )
    return rp.build_engine(args)


def test_prefill_rounds_run_from_the_same_state_and_clean_up(engine):
    ex = engine.executor
    drafter = ex.drafter
    bench = rp.PrefillRounds(ex, rp.CompileLog())
    shape = rp.RoundShape(chunk=24, context=16, num_decode=4, decode_kv_len=40)
    # every call passes the executor's plan/state check, so the reset restored the state
    first = bench.measure(shape, 3)
    again = bench.measure(shape, 2)
    assert first["calls"] == 3 and again["calls"] == 2
    assert bench.pool.num_used == 0
    assert (ex.slot_req == -1).all()
    assert ex.drafter is drafter


def test_propose_measurement_unwraps_the_drafter(engine):
    drafter = rp.make_drafter(engine.drafter.model, 3, 30, 5)
    out = rp.measure_propose(drafter, 3, 30, 5, 2, rp.CompileLog())
    assert out["chain_steps"] == 4 and out["wall_ms_per_step"] == pytest.approx(
        out["wall_ms"] / 4, abs=2e-3
    )
    assert "_forward_logits" not in vars(drafter) and "_pick" not in vars(drafter)
    assert (drafter.kv_len[:3] == 0).all()  # released


def test_compile_log_records_variants_and_what_differs():
    triton = pytest.importorskip("triton")
    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook
    log = rp.CompileLog().install()
    try:
        assert log.method == "triton.knobs.runtime.jit_cache_hook"

        class Info:  # what Triton passes as `fn`
            name = "_attn_kernel"
            jit_function = None

        def compile_info(seqs_pad, rows_div16):
            return {
                "signature": {"q_ptr": "*bf16", "num_rows": "i32", "SEQS_PAD": "constexpr"},
                "constants": {(2,): seqs_pad},
                "configs": [{(1,): [["tt.divisibility", 16]]} if rows_div16 else {}],
            }

        for i, (pad, div) in enumerate([(2, False), (64, False), (64, True)]):
            kw = {
                "key": f"k{i}",
                "repr": "_attn_kernel[...]",
                "fn": Info(),
                "compile": compile_info(pad, div),
                "is_manual_warmup": False,
                "already_compiled": False,
            }
            assert not runtime.jit_cache_hook(**kw)  # never tells Triton to skip compiling
            runtime.jit_post_compile_hook(**kw)
        assert log.since(1)["count"] == 2 and log.since(0)["kernels"] == ["_attn_kernel"]
        assert all(e["seconds"] is not None for e in log.events)
        (summary,) = log.summary()
        assert summary["variants"] == 3
        assert set(summary["differs_in"]) == {"SEQS_PAD", "num_rows"}
        assert summary["differs_in"]["SEQS_PAD"] == ["constexpr=2", "constexpr=64"]
    finally:
        log.uninstall()
    assert runtime.jit_cache_hook is before


def test_parts_past_the_time_budget_are_skipped_and_said_so(tmp_path):
    argv = [*TINY, "--out", str(tmp_path), "--time-budget", "0", "--chunks", "16"]
    argv += ["--contexts", "0", "--seq-scan", "2", "--draft-reqs", "1", "--draft-contexts", "8"]
    assert rp.main(argv) == 0
    record = json.loads((tmp_path / "round_probe.json").read_text())
    assert record["rounds"] == [] and record["drafts"] == [] and record["replay"] is None
    assert "refill replay" in record["skipped"] and "kernel table" in record["skipped"]
    assert len(record["skipped"]) == 1 + 2 + 1 + 1 + 1  # replay, 2 rounds, propose, scan, table
