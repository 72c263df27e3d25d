"""`hipfire-bench phase-profile` on the CPU: the kernel-name classifier on names the profiler
reports for cuBLAS, FlashAttention, vLLM, inductor, ATen and this project's own Triton
kernels; the busy time and per-phase sums of a made-up event list; the step counting of a
wave on a fake engine; the whole call with ours alone on `random:tiny` (vLLM replaced by a
stand-in that cannot be imported); and a merge that re-classifies a record's kernels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtests.lab.peer.children import ROOT
from loadtests.lab.phase_profile import main
from loadtests.lab.phases import classify as cl
from loadtests.lab.phases.child import profile_point
from loadtests.lab.phases.config import QUICK, PhaseConfig

NAMES = [
    ("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    (
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
        "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
        "gemm",
    ),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    (
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
        "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>>>>>(Params)",
        "attention",
    ),
    ("flash_fwd_splitkv_kernel", "attention"),
    ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, 0>", "attention"),
    ("kernel_unified_attention_2d", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
    ("triton_poi_fused_mul_silu_0", "activation"),
    (
        "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>>",
        "activation",
    ),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("_rms_norm_kernel", "norm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, float, int)", "norm"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "norm"),
    ("rotary_embedding_kernel", "rope"),
    (
        "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*)",
        "rope",
    ),
    ("triton_poi_fused_add_cat_index_mul_neg_slice_split_0", "rope"),
    (
        "at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "sampling",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
        "at::native::ArgMaxOps<float>, unsigned int, long, 4, 4> >",
        "sampling",
    ),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sampling"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u>", "sampling"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    (
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
        "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>",
        "copy",
    ),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>", "copy"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctorOnSelf_add<float>>", "other"),
    # this project's kernels (kernels/)
    ("_verify_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),
    ("_skinny_linear_kernel", "gemm"),
    ("_reduce_splits_kernel", "gemm"),
    ("_int4_skinny_kernel", "gemm"),
    ("_qk_norm_rope_kv_kernel", "rope"),
    ("_rope_and_write_kv_kernel", "rope"),
    ("_head_rms_norm_kernel", "norm"),
    ("_silu_and_mul_kernel", "activation"),
    ("_chunk_top_k_sorted_kernel", "sampling"),
    ("_merge_top_k_kernel", "sampling"),
    ("_accept_greedy_kernel", "sampling"),
    ("_accept_rejection_kernel", "sampling"),
]


@pytest.mark.parametrize(("name", "phase"), NAMES)
def test_kernel_names_classify(name, phase):
    assert cl.classify(name) == phase


def test_every_project_kernel_has_a_phase():
    """Each Triton kernel under kernels/ (a module-level function named *_kernel) matches a
    rule, so a kernel added there without a rule shows here rather than as "other" in a
    record."""
    kernel = re.compile(r"^def (\w+_kernel)\(", re.MULTILINE)
    names = {m for f in (ROOT / "kernels").glob("*.py") for m in kernel.findall(f.read_text())}
    assert {"_skinny_linear_kernel", "_verify_attention_kernel"} <= names
    assert {n: cl.classify(n) for n in names if cl.classify(n) == "other"} == {}


def test_busy_time_and_phase_sums_of_made_up_events():
    ev = cl.KernelEvent
    # two steps: a GEMM overlapping the norm after it by 1 us (programmatic dependent launch),
    # an attention kernel after a 3 us gap, a copy, one unknown kernel
    events = [
        ev("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 0.0, 10.0),
        ev("_rms_norm_kernel", 9.0, 12.0),
        ev("_verify_attention_kernel", 15.0, 20.0),
        ev("Memcpy DtoD (Device -> Device)", 20.0, 21.0),
        ev("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 30.0, 40.0),
        ev("_rms_norm_kernel", 40.0, 43.0),
        ev("_verify_attention_kernel", 43.0, 48.0),
        ev("mystery_kernel", 50.0, 52.0),
    ]
    assert cl.busy_us(events) == pytest.approx(12 + 6 + 18 + 2)
    raw = cl.summarize(events, num_steps=2)
    assert raw["busy_ms"] == pytest.approx(38 / 2 / 1e3) and raw["num_kernels"] == 4
    assert raw["kernels"][0] == {"name": events[0].name, "count": 2, "total_us": 20.0}
    point = {"C": 4, "steps": 2, "wall_ms": 0.05, **raw}
    d = cl.derive(point, top=3)
    ms = {k: v * 1e3 for k, v in d["phases_ms"].items()}  # us per step
    want = dict.fromkeys(cl.PHASES, 0.0) | {"gemm": 10, "attention": 5, "norm": 3}
    assert ms == pytest.approx(want | {"copy": 0.5, "other": 1})
    assert d["kernel_ms"] == pytest.approx(19.5e-3)
    assert d["overlap_ms"] == pytest.approx(0.5e-3)  # the 1 us overlap, per step
    assert d["host_gap_ms"] == pytest.approx(0.05 - 19e-3)
    assert [k["phase"] for k in d["top"]] == ["gemm", "attention", "norm"]
    assert d["top"][0]["count"] == 1 and d["top"][0]["share"] == pytest.approx(10 / 19.5)
    assert [k["name"] for k in d["other"]] == ["mystery_kernel"]
    cpu = cl.summarize([], num_steps=2)
    assert cpu["device_events"] is False
    assert cl.derive({"steps": 2, "wall_ms": 1.0, **cpu})["phases_ms"] is None


def test_device_events_keep_device_work_only():
    from torch.autograd import DeviceType

    def fe(name, device, start, end):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    prof = SimpleNamespace(
        events=lambda: [
            fe("aten::mm", DeviceType.CPU, 0, 5),
            fe("cudaGraphLaunch", DeviceType.CPU, 1, 2),
            fe("_skinny_linear_kernel", DeviceType.CUDA, 3, 7),
            fe("Stream Sync", DeviceType.CUDA, 7, 30),
        ]
    )
    assert cl.device_events(prof) == [cl.KernelEvent("_skinny_linear_kernel", 3.0, 7.0)]


class FakeEngine:
    """A batch-queue engine: a call either only schedules (no output) or brings every live
    request one token; the prompt's first token comes after two calls."""

    def __init__(self):
        self.live: dict[str, list[int]] = {}
        self.calls = 0

    def add(self, rid, prompt, max_tokens):
        assert prompt
        self.live[rid] = [0, max_tokens]

    def step(self):
        self.calls += 1
        if self.calls % 2:
            return []
        out = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            out.append((rid, 1, state[0] == state[1]))
            if state[0] == state[1]:
                del self.live[rid]
        return out


class ShortEngine(FakeEngine):
    """Ends every request after 4 tokens, whatever it was asked for."""

    def add(self, rid, prompt, max_tokens):
        super().add(rid, prompt, 4)


def test_window_steps_are_tokens_over_c():
    engine = FakeEngine()
    cfg = PhaseConfig(steps=6, warmup_steps=2, prompt_len=(8, 8))
    p = profile_point(engine, cfg, 3, vocab=512, use_cuda=False)
    assert not engine.live  # the wave ran to its end
    assert p["step_calls"] == 6 and p["steps"] == 3 and p["steps_unprofiled"] == 3
    assert p["prompt_tokens"] == 24 and p["device_events"] is False and p["wall_ms"] > 0
    with pytest.raises(RuntimeError, match="finished inside a window"):
        profile_point(ShortEngine(), cfg, 3, vocab=512, use_cuda=False)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A PYTHONPATH folder whose `vllm` raises on import."""
    folder = tmp_path_factory.mktemp("stand-in")
    (folder / "vllm").mkdir()
    (folder / "vllm" / "__init__.py").write_text("raise ImportError('vllm stand-in')\n")
    return folder


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, stand_in):
    out = tmp_path_factory.mktemp("quick")
    cmd = [sys.executable, "-m", "loadtests.lab.cli", "phase-profile", "--quick"]
    cmd += ["--engines", "hipfire,vllm", "--vllm-pythonpath", str(stand_in), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, out


def test_quick_run_writes_the_record(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr
    assert "hipfire-bench phase-profile: vllm not run (ImportError: vllm stand-in)" in proc.stderr
    record = json.loads((out / "decode-phases.json").read_text())
    ours = record["engines"]["hipfire"]
    assert "error" not in ours and not ours["errors"] and not ours["skipped"]
    assert ours["settings"]["spec_mode"] == "ar"
    assert ours["settings"]["enable_prefix_caching"] is False
    assert [p["C"] for p in ours["points"]] == list(QUICK.concurrency)
    for p in ours["points"]:
        assert p["steps"] == p["steps_unprofiled"] == QUICK.steps  # one token per call
        assert p["wall_ms"] > 0 and p["device_events"] is False and p["phases_ms"] is None
        assert p["prompt_tokens"] >= p["C"] * QUICK.prompt_len[0]
    assert record["missing"] == {"vllm": "ImportError: vllm stand-in"}
    assert record["device"] == "cpu" and record["ceilings"] == {}
    assert [r["C"] for r in record["roofline"]] == list(QUICK.concurrency)
    assert record["rules"] == [list(r) for r in cl.RULES]
    md = (out / "decode-phases.md").read_text()
    assert "| 2 | hipfire | no device |" in md and "- vllm: not run (ImportError" in md
    assert (out / "decode-phases.png").stat().st_size > 0
    assert "no device" in proc.stdout


def test_merge_reclassifies_and_lists_other(quick_run, tmp_path):
    _, out = quick_run
    record = json.loads((out / "decode-phases.json").read_text())
    for p in record["engines"]["hipfire"]["points"]:  # as a GPU run would have them
        p.update(device_events=True, busy_ms=0.5, num_kernels=3.0, wall_ms=0.8, steps=2)
        p["kernels"] = [
            {"name": "_skinny_linear_kernel", "count": 2, "total_us": 600.0},
            {"name": "_verify_attention_kernel", "count": 2, "total_us": 300.0},
            {"name": "brand_new_kernel", "count": 2, "total_us": 100.0},
        ]
    peer = json.loads(json.dumps(record))
    peer["engines"] = {"vllm": peer["engines"].pop("hipfire")}
    peer["engines"]["vllm"]["version"] = "0.0-fake"
    peer["missing"], peer["commit"] = {}, "fake"
    (tmp_path / "a.json").write_text(json.dumps(record))
    (tmp_path / "b.json").write_text(json.dumps(peer))
    args = ["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert main([*args, "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "decode-phases.json").read_text())
    assert set(merged["engines"]) == {"hipfire", "vllm"} and merged["missing"] == {}
    assert merged["versions"]["vllm"] == "0.0-fake"
    for res in merged["engines"].values():
        for p in res["points"]:
            assert p["phases_ms"]["gemm"] == pytest.approx(0.3)
            assert p["phases_ms"]["attention"] == pytest.approx(0.15)
            assert p["phases_ms"]["other"] == pytest.approx(0.05)
            assert p["overlap_ms"] == pytest.approx(0.0) and p["host_gap_ms"] == pytest.approx(0.3)
            assert [k["name"] for k in p["other"]] == ["brand_new_kernel"]
    md = (tmp_path / "m" / "decode-phases.md").read_text()
    assert "`brand_new_kernel` 0.050 ms" in md and "| 3 | vllm | 0.300 |" in md
    other = json.loads(json.dumps(peer))
    other["config"]["steps"] += 1
    (tmp_path / "c.json").write_text(json.dumps(other))
    bad = ["--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json")]
    assert main([*bad, "--out", str(tmp_path / "bad")]) == 2


def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--engines", "sglang"]) == 2
    assert main(["--out", str(tmp_path), "--prompt-len", "9,3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown engines: sglang" in err[0]
    assert not Path(tmp_path / "decode-phases.json").exists()
