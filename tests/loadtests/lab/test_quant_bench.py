"""`hipfire-bench quant` on the CPU: the whole --quick call (three children on `random:tiny`), the
record's fields and its ratio math; each format's roofline byte count; the greedy agreement
figures; and the in-memory layouts read back by the loader into exactly the weights they
encode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from executor.quant.int4 import Int4Linear
from executor.random_model import PRESETS, random_model
from loadtests.lab.peer.children import ROOT
from loadtests.lab.peer.workloads import wave_lens
from loadtests.lab.quant_layouts import (
    Layout,
    encode_fp8,
    encode_int4,
    group_index,
    quantized_model,
)
from loadtests.lab.quant_record import QUICK, QuantConfig, agreement, format_roofline


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    cmd = [sys.executable, "-m", "loadtests.lab.cli", "quant", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, out


def test_quick_run_record(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {p.name for p in out.iterdir()} >= {"quant.json", "quant.md", "quant.png"}
    record = json.loads((out / "quant.json").read_text())
    formats = record["formats"]
    assert list(formats) == ["bf16", "fp8", "w4a16"]
    n = QUICK.decode_tokens
    for name, res in formats.items():
        assert "error" not in res and not res["errors"] and not res["skipped"], name
        assert res["settings"]["spec_mode"] == "ar"
        assert res["settings"]["enable_prefix_caching"] is False
        assert res["format"]["dtype"] == "bfloat16"
        assert [p["C"] for p in res["wave"]] == list(QUICK.concurrency)
        for p in res["wave"]:
            assert p["prompt_tokens"] == sum(wave_lens(QUICK.peer(), p["C"]))
            if p["tN_s"] > p["t1_s"]:
                assert p["decode_tok_s"] == pytest.approx(p["C"] * n / (p["tN_s"] - p["t1_s"]))
        assert [len(t) for t in res["greedy_tokens"]] == [QUICK.agreement_tokens] * 2
        assert res["roofline"] and all(r["step_ms"] is None for r in res["roofline"])  # no ceilings
    assert "dequantized at load" in formats["fp8"]["format"]["linear_path"]
    assert "torch reference" in formats["w4a16"]["format"]["linear_path"]
    packed, dense = formats["w4a16"]["format"]["weight_bytes"], formats["bf16"]["format"]
    assert packed["static"] < dense["weight_bytes"]["static"]
    assert formats["bf16"]["agreement"] is None
    for name in ("fp8", "w4a16"):
        agree = formats[name]["agreement"]
        assert 0.0 <= agree["position_match"] <= 1.0 and agree["prompts"] == 2
    for row in record["ratios"]:
        base = {p["C"]: p for p in formats["bf16"]["wave"]}[row["C"]]["decode_tok_s"]
        for name in ("fp8", "w4a16"):
            mine = {p["C"]: p for p in formats[name]["wave"]}[row["C"]]["decode_tok_s"]
            assert row[name] == pytest.approx(mine / base)
    assert {(t["C"], t["format"]) for t in record["targets"]} == {
        (1, "fp8"),
        (1, "w4a16"),
        (64, "fp8"),
        (64, "w4a16"),
    }
    md = (out / "quant.md").read_text()
    assert "## Decode tokens/s over bf16's" in md and "| FP8 / bf16 |" in md
    assert (out / "quant.png").stat().st_size > 0


def test_each_format_has_its_own_roofline():
    cfg = QuantConfig(concurrency=(1, 64))
    shape = PRESETS["qwen3-8b"]
    ceilings = {"copy_read_plus_write_TBps": 4.0, "bf16_gemm_TFLOPs": 800.0}
    weights = {"static": 5_000_000_000, "per_row": 8192}
    bf16, fp8 = (format_roofline(cfg, shape, weights, f, ceilings) for f in ("bf16", "fp8"))
    for c, row in zip(cfg.concurrency, bf16):
        kv = sum(wave_lens(cfg.peer(), c)) + c * (cfg.decode_tokens + 1) / 2
        moved = weights["static"] + c * weights["per_row"] + kv * shape.kv_bytes_per_token(2)
        assert row["bytes_ms"] == pytest.approx(moved / 4e12 * 1e3)
        assert row["step_ms"] == max(row["bytes_ms"], row["flops_ms"])
        assert row["decode_tok_s"] == pytest.approx(c / row["step_ms"] * 1e3)
    # FP8 halves only the linear layers' GEMM term, not the attention's
    assert bf16[1]["bytes_ms"] == fp8[1]["bytes_ms"]
    assert bf16[1]["flops_ms"] / 2 < fp8[1]["flops_ms"] < bf16[1]["flops_ms"]
    assert format_roofline(cfg, shape, weights, "bf16", {})[0]["step_ms"] is None


def test_agreement_figures():
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = agreement(base, [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert got == {
        "prompts": 2,
        "tokens": 4,
        "position_match": 7 / 8,
        "mean_common_prefix": 3.0,
        "identical_prompts": 1,
    }
    assert agreement(base, None) is None and agreement(base, base[:1]) is None


def test_layouts_load_back_into_the_weights_they_encode():
    model = random_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    cfg = model.config
    gptq = quantized_model(model, Layout("gptq", group_size=32))
    fp8 = quantized_model(model, Layout("fp8", fp8_block=(32, 32)))
    q_rows = cfg.q_size
    for dense_lw, int4_lw, fp8_lw in zip(
        model.weights.layers, gptq.weights.layers, fp8.weights.layers
    ):
        assert isinstance(int4_lw.qkv, Int4Linear) and isinstance(int4_lw.down, Int4Linear)
        q = dense_lw.qkv[:q_rows]  # the q projection alone, as the layout encodes it
        g_idx = group_index(q.shape[1], 32, False, 0)
        want = encode_int4(q, "gptq", g_idx, q.shape[1] // 32)[1]
        torch.testing.assert_close(int4_lw.qkv.dequantize()[:q_rows], want, rtol=0, atol=0)
        # on a CPU the loader dequantizes FP8 at load: the checkpoint's exact values
        want = encode_fp8(dense_lw.down, "block", (32, 32))[1]
        torch.testing.assert_close(fp8_lw.down, want, rtol=0, atol=0)
        assert torch.equal(fp8_lw.input_norm, dense_lw.input_norm)
    assert gptq.weights.lm_head is gptq.weights.embed or torch.equal(
        gptq.weights.lm_head, model.weights.lm_head
    )


def test_spec_mode_flag(tmp_path, capsys):
    from loadtests.lab.quant_bench import build_parser, config_from_args, main

    args = build_parser().parse_args(["--out", str(tmp_path), "--quick", "--spec-mode", "adaptive"])
    cfg = config_from_args(args)
    assert (cfg.spec_mode, cfg.draft) == ("adaptive", "ngram")
    assert main(["--out", str(tmp_path), "--quick", "--spec-mode", "sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--spec-mode: ar or adaptive" in err
    assert not list(tmp_path.iterdir())  # refused before anything ran
