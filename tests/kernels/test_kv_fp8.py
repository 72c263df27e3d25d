"""FP8 KV caches in the kernels: the references' store and load rule (value / scale clamped to
e4m3's range, stored * scale), verify attention over an FP8 cache in Triton (the interpreter on a
CPU: fp8 loads convert exactly there), the Triton writers on inputs the interpreter's fp8 cast
rounds exactly, every writer and reader against its reference on a GPU, and the FP8 variants
compiled for sm_90 without one.

The interpreter's float32 -> float8 cast is not the hardware's: it rounds some values just below
a power of two to half their size. The interpreter tests of the writers therefore store e4m3
values times power-of-two scales, rotated at position 0 (cos 1, sin 0), whose division is exact;
the GPU tests take random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from executor.model_config import RopeConfig
from executor.rope import build_cos_sin_cache
from kernels.attention import verify_attention, verify_attention_ref
from kernels.fused_qk import qk_norm_rope_and_write_kv, qk_norm_rope_and_write_kv_ref
from kernels.kv_fp8 import FP8_E4M3_MAX, FP8_KV_DTYPE, kv_load_ref, kv_store_ref
from kernels.rope_kv import rope_and_write_kv, rope_and_write_kv_ref
from tests.kernels.paged import ATTENTION_TOL, ragged_batch, rel_err
from tests.kernels.qkv_cases import QkvCase, build_inputs
from tests.kernels.sm90 import run_compile_check, triton_backends

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = FP8_KV_DTYPE


def _scales(num_kv_heads: int, seed: int, device=DEV) -> torch.Tensor:
    """Distinct per-head scales in [0.25, 4): float32 [Hkv]."""
    g = torch.Generator().manual_seed(seed)
    return (2 ** (torch.rand(num_kv_heads, generator=g) * 4 - 2)).to(device)


def _to_fp8(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A cache [blocks, page, Hkv, D] stored as FP8 with per-head `scale`."""
    rows = cache.reshape(-1, *cache.shape[2:])
    return kv_store_ref(rows, scale, FP8).view(cache.shape)


def _e4m3_values(shape, gen: torch.Generator) -> torch.Tensor:
    """float32 values every one of which e4m3 holds exactly (random bytes, NaNs dropped)."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    values = raw.view(FP8).float()
    return torch.where(values.isnan(), torch.zeros_like(values), values)


# -- the references' rule ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_then_load_round_trips_within_e4m3_error(dtype):
    g = torch.Generator().manual_seed(0)
    scale = _scales(4, seed=1, device="cpu")
    x = (torch.randn(300, 4, 64, generator=g) * 3).to(dtype)  # [n, Hkv, D]
    stored = kv_store_ref(x, scale, FP8)
    assert stored.dtype == FP8 and stored.element_size() == 1
    back = kv_load_ref(stored, scale)
    # 3 mantissa bits: a normal value is off by at most half a step, 1/16 of it; below the
    # normal range (2**-6 after the scale) the step is fixed at 2**-9
    bound = x.float().abs() / 16 + scale[:, None] * 2**-10
    assert ((back - x.float()).abs() <= bound).all()
    # values past the range clamp to +-448 * scale, never to NaN or inf
    big = torch.tensor([1e4, -1e4, 500.0]).to(dtype)[:, None, None].expand(3, 4, 2) * scale[:, None]
    back = kv_load_ref(kv_store_ref(big, scale, FP8), scale)
    assert torch.equal(back[:2].abs(), (FP8_E4M3_MAX * scale[:, None]).expand(2, 4, 2))
    assert torch.equal(back[2], (FP8_E4M3_MAX * scale[:, None]).expand(4, 2))
    # a cache of the model's dtype stores and reads the values as they are
    assert kv_store_ref(x, None, dtype) is x
    assert torch.equal(kv_load_ref(x, None), x.float())


def test_reference_writers_store_what_the_rule_gives():
    """The fused reference (and the RoPE + store one under it) with an FP8 cache stores exactly
    the rule applied to what it stores in a cache of the model's dtype; q is unchanged."""
    case = QkvCase(
        num_rows=7, num_q_heads=6, num_kv_heads=2, head_dim=32, rope=RopeConfig(),
        is_neox=True, qk_norm=True, dtype=torch.bfloat16, device="cpu", page_size=4,
    )  # fmt: skip
    inputs = build_inputs(case)
    k_scale, v_scale = _scales(2, seed=2, device="cpu"), _scales(2, seed=3, device="cpu")
    plain = {**inputs, "k_cache": torch.zeros_like(inputs["k_cache"]),
             "v_cache": torch.zeros_like(inputs["v_cache"])}  # fmt: skip
    fp8 = {**inputs, "k_cache": torch.zeros(inputs["k_cache"].shape, dtype=FP8),
           "v_cache": torch.zeros(inputs["v_cache"].shape, dtype=FP8)}  # fmt: skip
    q = qk_norm_rope_and_write_kv_ref(**plain, num_q_heads=6, is_neox=True)
    q8 = qk_norm_rope_and_write_kv_ref(
        **fp8, num_q_heads=6, is_neox=True, k_scale=k_scale, v_scale=v_scale
    )
    assert torch.equal(q, q8)
    assert torch.equal(fp8["k_cache"], _to_fp8(plain["k_cache"], k_scale))
    assert torch.equal(fp8["v_cache"], _to_fp8(plain["v_cache"], v_scale))


def test_reference_attention_reads_stored_times_scale():
    batch = ragged_batch([1, 5, 12], [40, 9, 0], num_q_heads=8, num_kv_heads=2, head_dim=32,
                         page_size=4, dtype=torch.float32, seed=4)  # fmt: skip
    q, k, v, *lens = batch
    k_scale, v_scale = _scales(2, seed=5, device="cpu"), _scales(2, seed=6, device="cpu")
    k8, v8 = _to_fp8(k, k_scale), _to_fp8(v, v_scale)
    deq_k = kv_load_ref(k8.flatten(0, 1), k_scale).view(k.shape)
    deq_v = kv_load_ref(v8.flatten(0, 1), v_scale).view(v.shape)
    for causal in (True, False):
        got = verify_attention_ref(
            q, k8, v8, *lens, 0.17, causal=causal, k_scale=k_scale, v_scale=v_scale
        )
        assert torch.equal(got, verify_attention_ref(q, deq_k, deq_v, *lens, 0.17, causal=causal))


def test_an_fp8_cache_needs_float32_scales_per_kv_head():
    q, k, v, *lens = ragged_batch([2], [3], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                  page_size=4, dtype=torch.float32, device=DEV)  # fmt: skip
    k8, v8 = k.to(FP8), v.to(FP8)
    ones = torch.ones(2, device=DEV)
    with pytest.raises(AssertionError, match="needs k_scale"):
        verify_attention_ref(q, k8, v8, *lens, 0.1)
    with pytest.raises(AssertionError, match="float32"):
        verify_attention_ref(q, k8, v8, *lens, 0.1, k_scale=ones[:1], v_scale=ones)
    with pytest.raises(AssertionError, match="q's dtype or fp8"):
        verify_attention(q, k.half(), v.half(), *lens, 0.1)


# -- Triton: the interpreter on a CPU, the real kernels on a GPU ------------------------------
@pytest.mark.parametrize(
    "q_lens, ctx_lens, gqa, num_splits, causal",
    [
        ([1, 1, 1], [70, 5, 33], 4, 3, True),  # AR rows, split KV
        ([6, 1, 20], [17, 40, 0], 2, 1, True),  # a speculative group, an AR row, a prefill
        ([8, 8], [24, 3], 4, None, False),  # block drafter blocks
    ],
)
@pytest.mark.parametrize("pipeline", [False, True])
def test_triton_attention_over_fp8_matches_reference(
    tiles, q_lens, ctx_lens, gqa, num_splits, causal, pipeline
):
    tiles(pipeline_qk=int(pipeline), lazy_rescale=int(pipeline))
    q, k, v, *lens = ragged_batch(q_lens, ctx_lens, num_q_heads=2 * gqa, num_kv_heads=2,
                                  head_dim=32, page_size=4, dtype=torch.float32,
                                  device=DEV, pad_rows=1, seed=len(q_lens))  # fmt: skip
    k_scale, v_scale = _scales(2, seed=7), _scales(2, seed=8)
    k8, v8 = _to_fp8(k, k_scale), _to_fp8(v, v_scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = torch.full_like(q, float("nan"))
    verify_attention(q, k8, v8, *lens, 0.2, out, num_splits=num_splits, causal=causal, **scales)
    ref = verify_attention_ref(q, k8, v8, *lens, 0.2, causal=causal, **scales)
    assert (out[-1] == 0).all() and not out.isnan().any()
    assert rel_err(out, ref) < ATTENTION_TOL[torch.float32]


def _exact_rows(num_rows: int, heads: int, head_dim: int, scale: torch.Tensor, gen):
    """[N, heads, D] float32 rows of e4m3 values times each head's power-of-two scale, a few
    past the range (they clamp)."""
    rows = _e4m3_values((num_rows, heads, head_dim), gen) * scale[:, None]
    rows[0, :, 0] = 1e4 * scale  # clamps to 448 * scale
    rows[1, :, 1] = -1e4 * scale
    return rows


@pytest.mark.parametrize("rot_dim", [32, 16])  # 16: partial rotary, the tail copied
def test_triton_writers_store_fp8_like_the_references(rot_dim):
    g = torch.Generator().manual_seed(9)
    n, hq, hkv, d, page = 6, 4, 2, 32, 4
    k_scale = torch.tensor([0.5, 4.0], device=DEV)  # powers of two: the division is exact
    v_scale = torch.tensor([2.0, 0.25], device=DEV)
    cos_sin = build_cos_sin_cache(RopeConfig(rotary_dim=rot_dim), d, 8, DEV)
    positions = torch.zeros(n, dtype=torch.int64, device=DEV)  # cos 1, sin 0: k as given
    slots = torch.randperm(5 * page, generator=g)[:n].to(DEV)
    slots[3] = -1  # a padded row stores nothing
    q = torch.randn(n, hq, d, generator=g).to(DEV)
    k = _exact_rows(n, hkv, d, k_scale.cpu(), g).to(DEV)
    v = _exact_rows(n, hkv, d, v_scale.cpu(), g).to(DEV)
    scales = dict(k_scale=k_scale, v_scale=v_scale)

    def caches():
        return [torch.zeros((5, page, hkv, d), dtype=FP8, device=DEV) for _ in "kv"]

    # the fused kernel (no q/k norm) over the projection output q | k | v
    qkv = torch.cat([q, k, v], dim=1).reshape(n, -1)
    args = (None, None, 1e-6, positions, cos_sin, slots)
    got, want = caches(), caches()
    q_got = qk_norm_rope_and_write_kv(qkv, *args, *got, num_q_heads=hq, is_neox=True, **scales)
    q_want = qk_norm_rope_and_write_kv_ref(qkv, *args, *want, num_q_heads=hq, is_neox=True,
                                           **scales)  # fmt: skip
    assert torch.allclose(q_got, q_want, atol=1e-5)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (want[0].view(torch.uint8) != 0).sum() > 0
    # the in-place RoPE + store kernel
    got, want = caches(), caches()
    rope_and_write_kv(q.clone(), k.clone(), v, positions, cos_sin, slots, *got, is_neox=True,
                      **scales)  # fmt: skip
    rope_and_write_kv_ref(q.clone(), k.clone(), v, positions, cos_sin, slots, *want,
                          is_neox=True, **scales)  # fmt: skip
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    stored = kv_load_ref(want[0].flatten(0, 1), k_scale)
    assert stored.abs().max() == FP8_E4M3_MAX * k_scale.max()  # the clamp


# -- GPU: random inputs, bf16, Qwen3-8B-like heads --------------------------------------------
def _close_in_e4m3(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """FP8 caches [blocks, page, Hkv, D] that differ at most by one e4m3 step where they differ
    (the kernel's float32 arithmetic may land on the other side of a rounding tie), and
    rarely."""
    a = kv_load_ref(got.flatten(0, 1), scale)
    b = kv_load_ref(want.flatten(0, 1), scale)
    differ = a != b
    assert differ.float().mean() < 1e-3, float(differ.float().mean())
    step = b.abs() / 8 + scale[:, None] * 2**-9
    assert ((a - b).abs() <= step).all()


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("rotary_dim", [0, 64])
def test_gpu_fused_qk_fp8_matches_reference(qk_norm, rotary_dim):
    from executor.model_config import RopeConfig

    case = QkvCase(num_rows=300, num_q_heads=32, num_kv_heads=8, head_dim=128,
                   rope=RopeConfig(theta=1e6, rotary_dim=rotary_dim), is_neox=True,
                   qk_norm=qk_norm, dtype=torch.bfloat16, device="cuda", page_size=16)  # fmt: skip
    inputs = build_inputs(case)
    k_scale, v_scale = _scales(8, seed=10, device="cuda"), _scales(8, seed=11, device="cuda")
    results = []
    for fn in (qk_norm_rope_and_write_kv, qk_norm_rope_and_write_kv_ref):
        caches = [torch.zeros(inputs["k_cache"].shape, dtype=FP8, device="cuda") for _ in "kv"]
        args = {**inputs, "k_cache": caches[0], "v_cache": caches[1]}
        q = fn(**args, num_q_heads=32, is_neox=True, k_scale=k_scale, v_scale=v_scale)
        results.append((q, *caches))
    (q, k, v), (q_ref, k_ref, v_ref) = results
    assert rel_err(q, q_ref) < 1e-2
    _close_in_e4m3(k, k_ref, k_scale)  # k: as close as the bf16 cache's k is to its reference
    # v: the same IEEE division and cast of the same values
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_rope_and_write_kv_fp8_matches_reference():
    g = torch.Generator().manual_seed(12)
    n, hq, hkv, d = 500, 32, 8, 128
    q, k, v = (torch.randn(n, h, d, generator=g).to("cuda", torch.bfloat16)
               for h in (hq, hkv, hkv))  # fmt: skip
    from executor.model_config import RopeConfig

    cos_sin = build_cos_sin_cache(RopeConfig(theta=1e6, rotary_dim=64), d, 4096, "cuda")
    positions = torch.randint(0, 4096, (n,), generator=g).cuda()
    slots = torch.randperm(64 * 16, generator=g)[:n].cuda()
    k_scale, v_scale = _scales(hkv, seed=13, device="cuda"), _scales(hkv, seed=14, device="cuda")
    results = []
    for fn in (rope_and_write_kv, rope_and_write_kv_ref):
        caches = [torch.zeros((64, 16, hkv, d), dtype=FP8, device="cuda") for _ in "kv"]
        fn(q.clone(), k.clone(), v, positions, cos_sin, slots, *caches, is_neox=True,
           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        results.append(caches)
    _close_in_e4m3(results[0][0], results[1][0], k_scale)
    assert torch.equal(results[0][1].view(torch.uint8), results[1][1].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, ctx, num_splits", [(1, 8000, None), (8, 3000, 1), (512, 100, 1)])
def test_gpu_attention_over_fp8_matches_reference(rows, ctx, num_splits):
    q, k, v, *lens = ragged_batch([rows] * 4, [ctx] * 4, num_q_heads=32, num_kv_heads=8,
                                  head_dim=128, page_size=16, dtype=torch.bfloat16,
                                  device="cuda", seed=15)  # fmt: skip
    k_scale, v_scale = _scales(8, seed=16, device="cuda"), _scales(8, seed=17, device="cuda")
    k8, v8 = _to_fp8(k, k_scale), _to_fp8(v, v_scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    scale = 1 / math.sqrt(128)
    out = verify_attention(q, k8, v8, *lens, scale, num_splits=num_splits, max_q_len=rows,
                           **scales)  # fmt: skip
    ref = verify_attention_ref(q.float(), k8, v8, *lens, scale, **scales)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_captured_fp8_layer_reads_its_scales_from_the_device():
    """A graph of the K/V store and attention replays with the scales the tensors hold at
    replay: they are inputs, not constants baked at capture."""
    g = torch.Generator().manual_seed(18)
    hq, hkv, d = 32, 8, 128
    # two sequences of two rows at positions 0 and 1, each in a page of its own
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g).to("cuda", torch.bfloat16)
    norms = [torch.rand(d, generator=g).to("cuda", torch.bfloat16) + 0.5 for _ in "qk"]
    positions = torch.tensor([0, 1, 0, 1], device="cuda")
    slots = torch.tensor([16, 17, 48, 49], device="cuda")
    cos_sin = build_cos_sin_cache(RopeConfig(theta=1e6), d, 16, "cuda")
    cu_q_lens = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([2, 2], dtype=torch.int32, device="cuda")
    block_tables = torch.tensor([[1], [3]], dtype=torch.int32, device="cuda")
    k8, v8 = (torch.zeros((4, 16, hkv, d), dtype=FP8, device="cuda") for _ in "kv")
    k_scale, v_scale = _scales(hkv, seed=19, device="cuda"), _scales(hkv, seed=20, device="cuda")
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = torch.empty((4, hq, d), dtype=torch.bfloat16, device="cuda")

    def layer():
        q = qk_norm_rope_and_write_kv(qkv, *norms, 1e-6, positions, cos_sin, slots, k8, v8,
                                      num_q_heads=hq, is_neox=True, **scales)  # fmt: skip
        verify_attention(q, k8, v8, cu_q_lens, seq_lens, block_tables, 0.088, out, **scales)

    layer()  # compiles outside the capture
    before = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    k_scale.mul_(2.0)
    v_scale.mul_(0.5)
    graph.replay()
    replayed = out.clone()
    layer()
    assert torch.equal(replayed, out)
    assert not torch.equal(replayed, before)


# -- sm_90 builds without a GPU ---------------------------------------------------------------
@pytest.mark.skipif("nvidia" not in triton_backends(), reason="Triton without its NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_fp8_variants_compile_for_sm90():
    assert run_compile_check("tests.kernels.kv_fp8_sm90_compile").count("ok ") == 4
