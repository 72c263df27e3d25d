"""`hipfire-bench peer-vllm` on the CPU: the whole call with ours alone on `random:tiny` (vLLM
replaced by a stand-in that cannot be imported), the record's fields, the ratio math against a
made-up vLLM record merged in, the roofline's byte count, the shape written for vLLM, and the
chat driver's refill and latency arithmetic on a fake engine with a fake clock."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from types import ModuleType, SimpleNamespace

import pytest

from executor.model_config import load_model_config
from executor.random_model import PRESETS
from loadtests.lab.peer import drive, report
from loadtests.lab.peer.children import ROOT, child_env
from loadtests.lab.peer.config import QUICK, PeerConfig
from loadtests.lab.peer.main import main
from loadtests.lab.peer.roofline import wave_roofline
from loadtests.lab.peer.shape import num_params, step_weight_bytes, write_hf_config
from loadtests.lab.peer.workloads import chat_lens, multiturn_lens, multiturn_requests, wave_lens


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A PYTHONPATH folder whose `vllm` raises on import: the vLLM-absent path, whatever is
    installed."""
    folder = tmp_path_factory.mktemp("stand-in")
    (folder / "vllm").mkdir()
    (folder / "vllm" / "__init__.py").write_text("raise ImportError('vllm stand-in')\n")
    return folder


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, stand_in):
    out = tmp_path_factory.mktemp("quick")
    cmd = [sys.executable, "-m", "loadtests.lab.cli", "peer-vllm", "--quick"]
    cmd += ["--engines", "hipfire,vllm", "--vllm-pythonpath", str(stand_in), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return proc, out


def test_quick_run_record(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "peer-vllm.json").read_text())
    ours = record["engines"]["hipfire"]
    assert "error" not in ours and not ours["errors"] and not ours["skipped"]
    assert ours["settings"]["enable_prefix_caching"] is False
    assert ours["settings"]["spec_mode"] == "ar"
    n = QUICK.decode_tokens
    assert [p["C"] for p in ours["wave"]] == list(QUICK.concurrency)
    for p in ours["wave"]:
        assert p["prompt_tokens"] == sum(wave_lens(QUICK, p["C"]))
        assert p["t1_s"] > 0 and p["wave_tok_s"] == pytest.approx(p["C"] * (1 + n) / p["tN_s"])
        if p["tN_s"] > p["t1_s"]:  # a loaded CPU can time the tiny wave's t1 above its tN
            assert p["decode_tok_s"] == pytest.approx(p["C"] * n / (p["tN_s"] - p["t1_s"]))
            assert p["step_ms"] == pytest.approx(1e3 * (p["tN_s"] - p["t1_s"]) / n)
        else:
            assert p["decode_tok_s"] is None
    for p in ours["chat"]:
        lens = chat_lens(QUICK, p["C"])
        assert p["num_requests"] == len(lens) == max(2 * p["C"], 3)
        assert p["output_tokens"] == sum(m for _, m in lens)
        assert p["ttft"]["n"] == p["num_requests"]
        assert p["itl"]["n"] == p["output_tokens"] - p["num_requests"]
        assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["wall_s"])
    assert record["missing"] == {"vllm": "ImportError: vllm stand-in"}
    assert record["ratios"] == {"wave": [], "chat": [], "multiturn": []}
    assert record["ceilings"] == {} and record["device"] == "cpu"
    assert [r["C"] for r in record["roofline"]] == list(QUICK.concurrency)
    assert all(r["step_ms"] is None and r["weight_bytes"] > 0 for r in record["roofline"])
    assert record["shape"]["num_params"] == num_params(PRESETS["tiny"])
    md = (out / "peer-vllm.md").read_text()
    assert "- vllm: not run (ImportError: vllm stand-in)" in md
    assert (out / "peer-vllm.png").stat().st_size > 0


def test_vllm_absent_message(quick_run, stand_in, tmp_path, capsys):
    proc, _ = quick_run
    lines = [x for x in proc.stderr.splitlines() if "peer-vllm" in x]
    assert lines == [
        "hipfire-bench peer-vllm: vLLM is not importable in a child process (ImportError: vllm "
        "stand-in); pip-install vllm or pass --vllm-pythonpath; measuring hipfire alone"
    ]
    args = ["--quick", "--engines", "vllm", "--vllm-pythonpath", str(stand_in)]
    rc = main([*args, "--out", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.endswith("pass --vllm-pythonpath")
    assert not (tmp_path / "none").exists()


def _fake_vllm(record: dict) -> dict:
    """A vLLM record of the same call: half our decode rate, twice our t1, 0.8 x our chat
    output rate, TTFT and ITL twice ours."""
    fake = copy.deepcopy(record)
    peer = fake["engines"].pop("hipfire")
    peer["version"] = "0.0-fake"
    for p in peer["wave"]:
        p["decode_tok_s"] /= 2
        p["t1_s"] *= 2
        p["wave_tok_s"] /= 4
    for p in peer["chat"]:
        p["output_tok_s"] *= 0.8
        for metric in ("ttft", "itl"):
            p[metric] = {k: v * 2 if k.endswith("_ms") else v for k, v in p[metric].items()}
    fake["engines"] = {"vllm": peer}
    fake["missing"] = {}
    fake["commit"] = "fake"
    return fake


def test_ratio_math_merged(quick_run, tmp_path):
    _, out = quick_run
    record = json.loads((out / "peer-vllm.json").read_text())
    for p in record["engines"]["hipfire"]["wave"]:  # fixed figures: none left to the clock
        p.update(decode_tok_s=100.0 * p["C"], t1_s=0.01 * p["C"], wave_tok_s=50.0 * p["C"])
    (tmp_path / "ours.json").write_text(json.dumps(record))
    (tmp_path / "vllm.json").write_text(json.dumps(_fake_vllm(record)))
    args = ["--merge", str(tmp_path / "ours.json"), str(tmp_path / "vllm.json")]
    assert main([*args, "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "peer-vllm.json").read_text())
    assert set(merged["engines"]) == {"hipfire", "vllm"} and merged["missing"] == {}
    assert merged["vllm"] == "0.0-fake"
    assert [r["C"] for r in merged["ratios"]["wave"]] == list(QUICK.concurrency)
    for r in merged["ratios"]["wave"]:
        assert r["decode_tok_s"] == pytest.approx(2.0)
        assert r["prefill_t1"] == pytest.approx(2.0)
        assert r["wave_tok_s"] == pytest.approx(4.0)
    for r in merged["ratios"]["chat"]:
        assert r["output_tok_s"] == pytest.approx(1.25)
        assert r["ttft_p50"] == pytest.approx(2.0) and r["itl_p90"] == pytest.approx(2.0)
    md = (tmp_path / "merged" / "peer-vllm.md").read_text()
    assert "| **2.000** |" in md and "| **1.250** |" in md
    # records of different workloads are not merged
    other = _fake_vllm(record)
    other["config"]["decode_tokens"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    bad = ["--merge", str(tmp_path / "ours.json"), str(tmp_path / "other.json")]
    assert main([*bad, "--out", str(tmp_path / "bad")]) == 2


def test_roofline_bytes_at_measured_bandwidth():
    shape = PRESETS["qwen3-8b"]
    assert 8.1e9 < num_params(shape) < 8.3e9  # Qwen3-8B: 8.19 B
    ceilings = {"copy_read_plus_write_TBps": 4.0, "bf16_gemm_TFLOPs": 800.0}
    cfg = PeerConfig(concurrency=(1, 256), decode_tokens=127)
    rows = wave_roofline(cfg, shape, "bfloat16", ceilings)
    for row in rows:
        c = row["C"]
        # every weight but the untied input embedding, of which only C rows
        weights = 2 * (num_params(shape) - (shape.vocab_size - c) * shape.hidden_size)
        kv = (sum(wave_lens(cfg, c)) + c * 64) * 2 * 36 * 8 * 128 * 2
        assert row["weight_bytes"] == weights == step_weight_bytes(shape, 2, c)
        assert row["kv_bytes"] == kv
        assert row["bytes_ms"] == pytest.approx((weights + kv) / 4e12 * 1e3)
        assert row["step_ms"] == max(row["bytes_ms"], row["flops_ms"])
        assert row["decode_tok_s"] == pytest.approx(c / row["step_ms"] * 1e3)
    assert rows[1]["bytes_ms"] > rows[1]["flops_ms"]  # decode at C=256 is still memory-bound


def test_shape_for_vllm_round_trips(tmp_path):
    shape = PRESETS["qwen3-8b"]
    loaded = load_model_config(write_hf_config(shape, tmp_path / "hf"))
    # the llama3 / yarn scaling fields mean nothing under default RoPE
    assert (loaded.rope.rope_type, loaded.rope.theta) == ("default", shape.rope.theta)
    assert dataclasses.replace(loaded, rope=shape.rope) == shape
    env = child_env("vllm", "/a:/b")
    assert env["PYTHONPATH"].split(":")[:3] == ["/a", "/b", str(ROOT)]
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in child_env("hipfire", "/a:/b")


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3.5"])
def test_num_params_counts_as_the_model_does(name):
    import torch

    from executor.random_model import random_model

    model = random_model(name, device=torch.device("cpu"), dtype=torch.float32)
    assert num_params(PRESETS[name]) == model.num_params


def test_hybrid_roofline_moves_the_recurrent_state():
    from executor.recurrent_state import RecurrentStates

    shape = PRESETS["qwen3.5-27b"]
    assert 26.8e9 < num_params(shape) < 27.0e9  # Qwen3.5-27B's text model
    ceilings = {"copy_read_plus_write_TBps": 4.0, "bf16_gemm_TFLOPs": 800.0}
    cfg = PeerConfig(model="random:qwen3.5-27b", concurrency=(1, 64), decode_tokens=127)
    for row in wave_roofline(cfg, shape, "bfloat16", ceilings):
        state = 2 * row["C"] * RecurrentStates.bytes_per_slot(shape, 2)
        assert row["state_bytes"] == state > 0
        moved = row["weight_bytes"] + row["kv_bytes"] + state
        assert row["bytes_ms"] == pytest.approx(moved / 4e12 * 1e3)
    assert (
        wave_roofline(PeerConfig(), PRESETS["qwen3-8b"], "bfloat16", ceilings)[0]["state_bytes"]
        == 0
    )


# -- the chat driver on a fake engine --------------------------------------------------------
class FakeEngine:
    """One token per live request per step, each step 10 ms on the fake clock; `short` ends
    every request one token early."""

    def __init__(self, clock: list[float], capacity: int, short: bool = False):
        self.clock, self.capacity, self.short = clock, capacity, short
        self.live: dict[str, list[int]] = {}
        self.max_live = 0

    def generate(self, prompts, max_tokens):
        self.clock[0] += 0.010 * max_tokens
        return [max_tokens] * len(prompts)

    def add(self, req_id, prompt, max_tokens):
        assert prompt
        self.live[req_id] = [0, max_tokens - self.short]
        self.max_live = max(self.max_live, len(self.live))

    def step(self):
        self.clock[0] += 0.010
        moved = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            moved.append((rid, 1, state[0] == state[1]))
            if state[0] == state[1]:
                del self.live[rid]
        return moved


@pytest.fixture
def fake_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(drive.time, "perf_counter", lambda: clock[0])
    return clock


def test_chat_refill_and_latencies(fake_clock):
    engine = FakeEngine(fake_clock, capacity=3)
    point = drive.chat_point(engine, QUICK, 3, vocab=512)
    lens = chat_lens(QUICK, 3)
    assert engine.max_live == 3 and not engine.live
    assert point["output_tokens"] == sum(m for _, m in lens)
    assert point["ttft"]["p50_ms"] == pytest.approx(10.0)
    assert point["itl"]["max_ms"] == pytest.approx(10.0)
    assert point["itl"]["n"] == point["output_tokens"] - len(lens)
    assert point["output_tok_s"] == pytest.approx(point["output_tokens"] / point["wall_s"])
    with pytest.raises(RuntimeError, match="short output"):
        drive.chat_point(FakeEngine(fake_clock, 3, short=True), QUICK, 3, vocab=512)


def test_points_past_the_deadline_are_skipped(fake_clock):
    result = {"engine": "fake", "skipped": [], "errors": []}
    engine = FakeEngine(fake_clock, capacity=3)
    drive.run_points(engine, QUICK, 512, deadline=0.0, result=result, save=lambda: None)
    assert result["wave"] == [] and result["chat"] == []
    assert len(result["skipped"]) == 2 * len(QUICK.concurrency)
    result = {"engine": "fake", "skipped": [], "errors": []}
    short = FakeEngine(fake_clock, capacity=3, short=True)
    drive.run_points(short, QUICK, 512, deadline=2e9, result=result, save=lambda: None)
    assert len(result["wave"]) == len(QUICK.concurrency)  # its generate() is exact
    assert result["wave"][0]["step_ms"] == pytest.approx(10.0)
    assert [e["workload"] for e in result["errors"]] == ["chat"]  # stopped at the first C


# -- the vLLM adapter on a stand-in of vLLM's offline engine -----------------------------------
class FakeVllmEngine:
    """Engine ids are ours plus "-<8 chars>"; `cumulative`: outputs carry every token so far
    and add_request returns nothing (older releases), else each step's new tokens only."""

    def __init__(self, clock: list[float], cumulative: bool):
        self.clock, self.cumulative = clock, cumulative
        self.live: dict[str, list[int]] = {}

    def add_request(self, req_id, prompt, params):
        assert prompt["prompt_token_ids"] and params["ignore_eos"]
        assert ("output_kind" in params) != self.cumulative
        self.live[f"{req_id}-a1b2c3d4"] = [0, params["max_tokens"]]
        return None if self.cumulative else f"{req_id}-a1b2c3d4"

    def step(self):
        self.clock[0] += 0.010
        outs = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            done = state[0] == state[1]
            ids = [7] * (state[0] if self.cumulative else 1)
            out = SimpleNamespace(token_ids=ids)
            outs.append(SimpleNamespace(request_id=rid, outputs=[out], finished=done))
            if done:
                del self.live[rid]
        return outs


@pytest.mark.parametrize("cumulative", [False, True])
def test_vllm_adapter_maps_ids_and_counts_tokens(monkeypatch, fake_clock, cumulative):
    vllm = ModuleType("vllm")
    vllm.SamplingParams = dict
    sampling = ModuleType("vllm.sampling_params")
    if not cumulative:
        sampling.RequestOutputKind = SimpleNamespace(DELTA="delta")
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    for name, mod in (("vllm", vllm), ("vllm.sampling_params", sampling), ("vllm.inputs", inputs)):
        monkeypatch.setitem(sys.modules, name, mod)
    from loadtests.lab.peer.vllm_child import VllmBackend

    llm = SimpleNamespace(llm_engine=FakeVllmEngine(fake_clock, cumulative))
    point = drive.chat_point(VllmBackend(llm), QUICK, 3, vocab=512)
    assert point["output_tokens"] == sum(m for _, m in chat_lens(QUICK, 3))
    assert point["itl"]["max_ms"] == pytest.approx(10.0)


# -- the multi-turn workload -------------------------------------------------------------------
def test_multiturn_prompts_extend_the_turn_before():
    cfg = dataclasses.replace(QUICK, workloads=("multiturn",))
    convs = multiturn_requests(cfg, 3, vocab=512)
    lens = multiturn_lens(cfg, 3)
    assert len(convs) == max(cfg.mt_waves * 3, cfg.mt_min_conversations)
    system = convs[0][0][0][: cfg.mt_system_len]
    for conv, turn_lens in zip(convs, lens):
        assert len(conv) == cfg.mt_turns
        history = cfg.mt_system_len
        for t, ((prompt, max_tokens), (user_len, reply_len)) in enumerate(zip(conv, turn_lens)):
            assert prompt[: cfg.mt_system_len] == system
            assert max_tokens == reply_len and len(prompt) == history + user_len
            if t:  # the earlier prompt, then a reply of its length, then the user message
                before, reply_before = conv[t - 1]
                assert prompt[: len(before)] == before
                assert len(prompt) == len(before) + reply_before + user_len
            history = len(prompt) + reply_len
        assert history <= cfg.max_model_len
    assert convs[1][0][0] != convs[0][0][0]  # conversations differ after the system prompt


def test_multiturn_driver_sends_turns_in_order(fake_clock):
    cfg = dataclasses.replace(QUICK, workloads=("multiturn",))
    engine = FakeEngine(fake_clock, capacity=2)
    sent: list[str] = []
    add = engine.add

    def add_logged(req_id, prompt, max_tokens):
        turn = int(req_id.rsplit("-", 1)[1])
        conv = req_id.rsplit("-", 1)[0]
        assert turn == 0 or f"{conv}-{turn - 1}" not in engine.live  # the turn before is done
        sent.append(req_id)
        add(req_id, prompt, max_tokens)

    engine.add = add_logged
    point = drive.multiturn_point(engine, cfg, 2, vocab=512)
    lens = multiturn_lens(cfg, 2)
    assert engine.max_live == 2 and not engine.live
    assert point["num_requests"] == len(sent) == cfg.mt_turns * len(lens)
    assert point["output_tokens"] == sum(m for conv in lens for _, m in conv)
    assert point["ttft"]["n"] == point["num_requests"]
    assert point["ttft_first_turn"]["n"] == len(lens)
    assert point["ttft_later_turns"]["n"] == point["num_requests"] - len(lens)
    assert point["ttft"]["p50_ms"] == pytest.approx(10.0) and "prefix_cache" not in point


def test_multiturn_through_the_engine_hits_the_cache():
    from loadtests.lab.peer.hipfire_child import build

    cfg = dataclasses.replace(QUICK, workloads=("multiturn",), prefix_caching=True)
    spec = {"config": cfg.to_json(), "model_path": "random:tiny", "dtype": "float32"}
    spec["prefix_caching"] = True
    result: dict = {}
    backend, vocab = build(spec, result)
    assert result["settings"]["enable_prefix_caching"] is True
    point = drive.multiturn_point(backend, cfg, 2, vocab)
    cache = point["prefix_cache"]
    # every turn but a conversation's first finds at least its system prompt's whole blocks
    block = backend.engine.config.block_size
    later = point["num_requests"] - point["num_conversations"]
    assert cache["hits"] >= later * (cfg.mt_system_len // block) * block > 0
    assert cache["hits"] < cache["queries"]
    md = report.markdown(_record_with(point, result))
    assert "## Multi-turn" in md and "| 2 | hipfire | on |" in md


def _record_with(point: dict, result: dict) -> dict:
    cfg = dataclasses.replace(QUICK, workloads=("multiturn",), prefix_caching=True)
    engines = {
        "hipfire": {**result, "multiturn": [point]},
        "hipfire-nocache": {"settings": {"enable_prefix_caching": False}, "multiturn": [point]},
    }
    return report.build_record(
        cfg,
        {"model": cfg.model, "dtype": "float32", "num_params": 1, "hf_config": {}},
        {},
        [],
        engines,
        {},
        {"date": "d", "commit": "c", "elapsed_s": 1.0, "device": "cpu", "torch": "t"},
    )
