"""`--kv-cache-dtype fp8` on a CPU: the CPU op set stores and reads an FP8 cache bitwise as the
references do, a tiny model decodes with it close to its float32 KV and deterministically, a
checkpoint's per-head k/v scales are read and applied, the budget holds twice the blocks of a
bf16 cache, and bad values or devices are refused in one line. (Speculative decoding with an
FP8 cache against AR with one: `test_spec_exactness.py`; the Triton kernels:
`tests/kernels/test_kv_fp8.py`.)"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from executor import cpu_ops
from executor.kv_cache import KVCache, resolve_kv_cache_dtype
from executor.kv_scales import take_kv_scales
from executor.loader import load_model
from executor.model import AttnMetadata, Model
from executor.model_config import ModelLoadError
from hipfire_serve import LLM, SamplingParams
from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile.cache import profile_key
from hipfire_serve.engine_setup import build_engine_parts
from hipfire_serve.server.config import resolve
from kernels.attention import verify_attention_ref
from kernels.fused_qk import qk_norm_rope_and_write_kv_ref
from kernels.kv_fp8 import FP8_KV_DTYPE, kv_store_ref
from tests.executor.test_cpu_ops import CASES, _batch
from tests.fixtures.tiny_models import make_tiny_model

FP8 = FP8_KV_DTYPE
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint (2 KV heads) with FP8 KV scales: layer 0 a scalar k_scale and a
    per-head v_scale, layer 1 a per-head k_scale and no v_scale."""
    path = make_tiny_model(tmp_path_factory.mktemp("scaled"), "qwen3", seed=4)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    sd["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25, 2.0])
    sd["model.layers.1.self_attn.k_scale"] = torch.tensor([0.125, 4.0])
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- the CPU op set against the references ----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("case", CASES[1:4])
def test_cpu_ops_store_and_read_fp8_bitwise_as_the_references(case, qk_norm, dtype):
    q_lens, kv_lens, hq, hkv, pad, causal = case
    head_dim, num_blocks = 64, 64
    meta = _batch(q_lens, kv_lens, num_blocks, seed=len(q_lens) + hq, pad_rows=pad)
    n = meta.positions.shape[0]
    g = torch.Generator().manual_seed(8)
    cos_sin = torch.randn((512, head_dim), generator=g)
    scales = {f"{n}_scale": torch.rand(hkv, generator=g) + 0.25 for n in "kv"}
    caches = [(torch.randn((num_blocks, 16, hkv, head_dim), generator=g) * 4).to(FP8) for _ in "kv"]
    ref_caches = [c.clone() for c in caches]
    qkv = torch.randn((n, (hq + 2 * hkv) * head_dim), generator=g).to(dtype)
    norms = [torch.rand(head_dim).to(dtype) + 0.5 for _ in "qk"] if qk_norm else [None] * 2
    args = (meta.positions, cos_sin, meta.slot_mapping)
    kw = dict(num_q_heads=hq, is_neox=True, **scales)
    q_ref = qk_norm_rope_and_write_kv_ref(qkv, *norms, 1e-6, *args, *ref_caches, **kw)
    plan = cpu_ops.forward_plan(meta.positions, meta.slot_mapping, cos_sin, meta, causal)
    q = cpu_ops.qk_norm_rope_and_write_kv(qkv, *norms, 1e-6, *args, *caches, plan=plan, **kw)
    assert torch.equal(q, q_ref)
    assert _equal(caches[0], ref_caches[0]) and _equal(caches[1], ref_caches[1])
    lens = (meta.cu_q_lens, meta.seq_lens, meta.block_tables, 0.125)
    out_ref = verify_attention_ref(q_ref, *ref_caches, *lens, causal=causal, **scales)
    out = cpu_ops.verify_attention(q, *caches, *lens, causal=causal, plan=plan, **scales)
    assert torch.equal(out, out_ref)
    # without a plan the op set takes the references themselves
    out = cpu_ops.verify_attention(q, *caches, *lens, causal=causal, **scales)
    assert torch.equal(out, out_ref)


# -- a tiny model decoding --------------------------------------------------------------------
def _prefill_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """One prefill forward of `ids` over a fresh cache of the model's KV cache dtype."""
    n, dev = len(ids), model.device
    kv = KVCache.for_model(model, num_blocks=-(-n // 16), block_size=16)
    meta = AttnMetadata(
        positions=torch.arange(n, device=dev),
        slot_mapping=torch.arange(n, device=dev),
        cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(kv.num_blocks, dtype=torch.int32, device=dev)[None],
    )
    return model.logits(model.forward(torch.tensor(ids, device=dev), meta, kv.k, kv.v))


def _llm(path, kv_cache_dtype: str) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", draft="none",
               kv_cache_dtype=kv_cache_dtype, kv_cache_memory="8MiB")  # fmt: skip


def test_greedy_decoding_with_fp8_kv_tracks_float32_kv_and_is_deterministic(model_dir):
    llm32, llm8 = _llm(model_dir, "auto"), _llm(model_dir, "fp8")
    assert llm8.engine.executor.kv.k[0].dtype == FP8
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 20, 37, 60)]
    ref = [o.outputs[0].token_ids for o in llm32.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in llm8.generate(prompts, GREEDY)]
    # deterministic: again, and in a fresh engine
    assert [o.outputs[0].token_ids for o in llm8.generate(prompts, GREEDY)] == got
    assert [o.outputs[0].token_ids for o in _llm(model_dir, "fp8").generate(prompts, GREEDY)] == got
    # Free-running, a tiny random model's near-flat logits make one flipped token change the
    # rest; teacher-forced on the float32 greedy text, the FP8 cache's argmax is the float32
    # cache's at most positions (measured: 96%, as bf16 weights against float32 ones).
    common = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r))
              for r, t in zip(ref, got)]  # fmt: skip
    model = llm8.engine.target
    agree = []
    for prompt, out in zip(prompts, ref):
        ids = prompt + out
        want = torch.tensor(out)
        argmax = _prefill_logits(model, ids)[len(prompt) - 1 : -1].argmax(-1)  # [48]
        agree.append(float((argmax == want).float().mean()))
    mean = sum(agree) / len(agree)
    print(f"fp8 KV: greedy prefix agreement {common} of 48; teacher-forced {mean:.3f}")
    assert common[0] > 0 and mean >= 0.85, (common, agree)


# -- checkpoint scales ------------------------------------------------------------------------
def test_checkpoint_scales_are_read_per_head_and_applied(scaled_dir, caplog):
    model = load_model(scaled_dir, dtype="float32")
    s = model.kv_scales
    assert torch.equal(s.k[0], torch.tensor([0.5, 0.5]))
    assert torch.equal(s.v[0], torch.tensor([0.25, 2.0]))
    assert torch.equal(s.k[1], torch.tensor([0.125, 4.0]))
    assert torch.equal(s.v[1], torch.ones(2))
    assert s.describe() == "k/v scales from the checkpoint (per KV head) for 2/2 KV layers"
    # layer 0's K/V depend on the embeddings only: the FP8 cache holds exactly value / scale
    ids = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    caches = {}
    for dtype in (torch.float32, FP8):
        model.kv_cache_dtype = dtype
        kv = KVCache.for_model(model, num_blocks=3, block_size=16)
        meta = AttnMetadata(
            positions=torch.arange(40),
            slot_mapping=torch.arange(40),
            cu_q_lens=torch.tensor([0, 40], dtype=torch.int32),
            seq_lens=torch.tensor([40], dtype=torch.int32),
            block_tables=torch.arange(3, dtype=torch.int32)[None],
        )
        model.forward(torch.tensor(ids), meta, kv.k, kv.v)
        caches[dtype] = kv
    plain, fp8 = caches[torch.float32], caches[FP8]
    for stored, values, scale in ((fp8.k[0], plain.k[0], s.k[0]), (fp8.v[0], plain.v[0], s.v[0])):
        want = kv_store_ref(values.flatten(0, 1), scale, FP8).view(values.shape)
        assert _equal(stored, want)
    # the engine names where its scales came from
    with caplog.at_level(logging.INFO, logger="hipfire_serve.engine"):
        build_engine_parts(EngineConfig(model=str(scaled_dir), device="cpu", draft="none",
                                        kv_cache_dtype="fp8", kv_cache_memory="2MiB"))  # fmt: skip
    assert "KV cache in float8_e4m3fn: target k/v scales from the checkpoint (per KV head)" in (
        caplog.text
    )


def test_missing_scales_are_one_and_bad_ones_refused_in_one_line(model_dir):
    model = load_model(model_dir, dtype="float32")
    assert all(torch.equal(t, torch.ones(2)) for t in model.kv_scales.k + model.kv_scales.v)
    assert model.kv_scales.describe() == "k/v scales 1.0 (the checkpoint has none)"
    cfg = model.config
    for bad, why in ((torch.ones(3), "expected a scalar or \\[2\\]"),
                     (torch.tensor(-1.0), "finite and positive"),
                     (torch.tensor(float("inf")), "finite and positive")):  # fmt: skip
        with pytest.raises(ModelLoadError, match=why) as err:
            take_kv_scales({"model.layers.1.self_attn.v_scale": bad}, cfg, torch.device("cpu"))
        assert "\n" not in str(err.value) and "model.layers.1.self_attn.v_scale" in str(err.value)


# -- sizing and refusals ----------------------------------------------------------------------
def test_the_budget_holds_twice_the_blocks_of_a_bf16_cache(model_dir):
    def parts(kv_cache_dtype):
        return build_engine_parts(EngineConfig(model=str(model_dir), device="cpu", draft="none",
                                               dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                                               kv_cache_memory="4MiB"))  # fmt: skip

    bf16, fp8 = parts("auto"), parts("fp8_e4m3")
    assert fp8.executor.kv.k[0].dtype == FP8 and bf16.executor.kv.k[0].dtype == torch.bfloat16
    assert fp8.num_kv_blocks == 2 * bf16.num_kv_blocks
    assert fp8.executor.kv.num_bytes == bf16.executor.kv.num_bytes
    key = ("t", "none", torch.device("cpu"), torch.bfloat16, 16, 4)
    assert profile_key(*key) == profile_key(*key, kv_cache_dtype="auto")
    assert profile_key(*key) != profile_key(*key, kv_cache_dtype="fp8_e4m3")


def test_bad_values_are_one_line_errors(model_dir, capsys):
    msg = "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, got 'int8'"
    with pytest.raises(ValueError, match=msg) as err:
        EngineConfig(kv_cache_dtype="int8").validate()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="got 'fp8_e5m2'"):
        resolve([], environ={"HIPFIRE_KV_CACHE_DTYPE": "fp8_e5m2"})
    with pytest.raises(ValueError, match="got 'bf16'"):
        LLM(str(model_dir), device="cpu", kv_cache_dtype="bf16")
    with pytest.raises(SystemExit):
        resolve(["--kv-cache-dtype", "int8"], environ={})
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    engine, _ = resolve(["--kv-cache-dtype", "fp8"], environ={})
    assert engine.kv_cache_dtype == "fp8"


def test_fp8_is_refused_on_a_gpu_without_e4m3(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError) as err:
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("--kv-cache-dtype fp8 cannot run on cuda:0")
    assert "A100-SXM4-80GB is compute capability 8.0" in text and "8.9 or newer" in text
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0")) == FP8
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda:0")) == torch.bfloat16


# -- a GPU: the engine with FP8 KV, graphs on -------------------------------------------------
@pytest.mark.gpu
def test_gpu_engine_with_fp8_kv_speculates_exactly_and_tracks_bf16(model_dir, tmp_path):
    def llm(kv_cache_dtype, draft, spec_mode):
        return LLM(str(model_dir), device="cuda", dtype="bfloat16", draft=draft,
                   spec_mode=spec_mode, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB",
                   graphs="startup")  # fmt: skip

    g = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(1, 300, (3,), generator=g).tolist() * 8)[:n] for n in (9, 17, 24)]
    ar = [o.outputs[0].token_ids for o in llm("fp8", "none", "ar").generate(prompts, GREEDY)]
    spec = llm("fp8", "ngram", "spec")
    assert spec.engine.executor.kv.k[0].dtype == FP8
    outs = spec.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ar
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) > 0
    model = spec.engine.target
    for prompt, out in zip(prompts, ar):  # teacher-forced on the FP8 text, against bf16 KV
        ids = prompt + out
        model.kv_cache_dtype = torch.bfloat16
        want = _prefill_logits(model, ids)[len(prompt) - 1 : -1].argmax(-1)
        model.kv_cache_dtype = FP8
        got = _prefill_logits(model, ids)[len(prompt) - 1 : -1].argmax(-1)
        assert float((got.cpu() == want.cpu()).float().mean()) >= 0.85
