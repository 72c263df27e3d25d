"""The skinny linear kernel against the fp32 torch reference: tiny shapes in Triton's interpreter
on the CPU (fp16/fp32), the model's shapes in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.skinny_linear import (
    _COUNTERS,
    MAX_ROWS,
    TUNED,
    SkinnyConfig,
    choose_config,
    k_per_split,
    linear,
    rule_config,
    skinny_linear,
    skinny_linear_ref,
    wave_split,
)
from loadtests.lab.kernels import linear as bench_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Interpreter-sized launches: dot tiles need 16+ along each dimension.
CONFIGS = (
    SkinnyConfig(32, 32, 1, 4, 2, True),
    SkinnyConfig(16, 32, 3, 4, 2, True),  # split-K with a ragged last split, reduced in-kernel
    SkinnyConfig(16, 32, 3, 4, 2, True, False),  # the same reduced by the second kernel
    SkinnyConfig(16, 32, 1, 4, 2, False),
    SkinnyConfig(32, 16, 4, 4, 2, False),
)


def _inputs(num_rows: int, n: int, k: int, dtype: torch.dtype, seed: int, with_bias: bool):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn((num_rows, k), generator=gen, device=DEVICE).to(dtype)  # [M, K]
    w = (torch.randn((n, k), generator=gen, device=DEVICE) * 0.1).to(dtype)  # [N, K]
    bias = torch.randn((n,), generator=gen, device=DEVICE).to(dtype) if with_bias else None
    return x, w, bias


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("num_rows", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 128), (80, 200)])  # even, then ragged N and K
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(cfg, num_rows, n, k, with_bias):
    if not cfg.use_dot and num_rows > 4:
        num_rows = 4  # multiply-add tiles hold every row in registers: kept small
    x, w, bias = _inputs(num_rows, n, k, torch.float16, seed=num_rows + n, with_bias=with_bias)
    _check(skinny_linear(x, w, bias, cfg), skinny_linear_ref(x, w, bias), torch.float16)


@settings(max_examples=15)
@given(
    num_rows=st.integers(1, MAX_ROWS),
    n_blocks=st.integers(1, 4),
    n_extra=st.integers(0, 15),
    k=st.integers(16, 160),
    split_k=st.integers(1, 5),
    use_dot=st.booleans(),
    last_reduces=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_split(num_rows, n_blocks, n_extra, k, split_k, use_dot, last_reduces, seed):
    """Any rows, ragged N and K and any split count and reduction give the reference product
    (fp32), and the in-kernel reduction leaves its tile counters at zero for the next launch."""
    if not use_dot:
        num_rows = min(num_rows, 4)
    n = 16 * n_blocks + n_extra
    cfg = SkinnyConfig(16, 32, split_k, 4, 2, use_dot, last_reduces)
    x, w, bias = _inputs(num_rows, n, k, torch.float32, seed, with_bias=seed % 2 == 0)
    for _ in range(2):  # the second launch reuses the counters
        _check(skinny_linear(x, w, bias, cfg), skinny_linear_ref(x, w, bias), torch.float32)
    counters = _COUNTERS.get((0, w.data_ptr(), n))
    assert counters is None or not counters.any()


def test_linear_dispatch(monkeypatch):
    """The kernel takes shapes and row buckets with a measured winner in TUNED; more rows,
    non-contiguous K and untuned shapes go to torch."""
    cfg = SkinnyConfig(16, 32, 2, 4, 2, True)
    monkeypatch.setitem(TUNED, (32, 64, 16), cfg)
    x, w, bias = _inputs(17, 32, 64, torch.float16, seed=1, with_bias=True)
    assert torch.equal(linear(x, w, bias), torch.nn.functional.linear(x, w, bias))
    x_t = x.t().contiguous().t()[:10]  # [10, 64] with K strided
    assert torch.equal(linear(x_t, w), torch.nn.functional.linear(x_t, w))
    assert torch.equal(linear(x[:4], w), torch.nn.functional.linear(x[:4], w))  # bucket 4
    calls = []
    monkeypatch.setattr(
        "kernels.skinny_linear.skinny_linear", lambda *a: calls.append(a[3]) or skinny_linear(*a)
    )
    _check(linear(x[:10], w, bias), skinny_linear_ref(x[:10], w, bias), torch.float16)
    assert calls == [cfg]


def test_rejects_bad_shapes():
    x, w, _ = _inputs(4, 32, 64, torch.float16, seed=2, with_bias=False)
    with pytest.raises(AssertionError):
        skinny_linear(x[:, :32], w)  # K mismatch
    x17, _, _ = _inputs(17, 32, 64, torch.float16, seed=2, with_bias=False)
    with pytest.raises(AssertionError):
        skinny_linear(x17, w)  # more rows than the kernel holds
    with pytest.raises(AssertionError):
        skinny_linear(x, w.float())  # dtype mismatch


@given(
    n=st.integers(1, 200_000),
    k=st.sampled_from([256, 1024, 4096, 12288, 5000]),
    num_rows=st.integers(1, MAX_ROWS),
    num_sms=st.sampled_from([8, 78, 132]),
)
# a measured table entry (split 1 at 78 SMs, where the rule's wave fill would pick another):
# the property is the rule's, the table's entries are measurements
@example(n=6144, k=1024, num_rows=1, num_sms=78)
def test_config_rule_covers_k(n, k, num_rows, num_sms):
    """The rule's split covers K with whole tiles, and no other power-of-two split of at least
    two tiles of K fills the last wave by more than 2% more."""
    cfg = rule_config(n, k, num_rows, num_sms)
    per_split = k_per_split(k, cfg.block_k, cfg.split_k)
    assert per_split % cfg.block_k == 0 and per_split * cfg.split_k >= k
    slots = num_sms if cfg.use_dot else 4 * num_sms

    def fill(split):
        total = -(-n // cfg.block_n) * split
        return total / (-(-total // slots) * slots)

    others = [s for s in (1, 2, 4, 8, 16) if s == 1 or k // s >= 2 * cfg.block_k]
    assert all(fill(s) <= fill(cfg.split_k) + 0.02 for s in others)


def test_table_entries_come_before_the_rule():
    for (n, k, rows), cfg in list(TUNED.items())[:20]:
        assert choose_config(n, k, rows, 78) is cfg


def test_wave_split_of_model_shapes():
    """One program per SM on 132 SMs: o_proj's 64 tiles split in 2, qkv's 96 in 4."""
    assert wave_split(4096, 4096, 64, 256, 132) == 2
    assert wave_split(6144, 4096, 64, 256, 132) == 4
    assert wave_split(24576, 4096, 64, 256, 132) == 1


def test_bench_sweep_and_projection():
    """The sweep stays within 12 launches per shape; the projection weighs 36 layers + lm_head."""
    for n, k in bench_linear.SHAPES.values():
        for num_rows in bench_linear.ROWS:
            cands = bench_linear.candidates(n, k, num_rows, 132)
            assert len(cands) <= 12
            assert (len(cands) > 0) == (num_rows <= MAX_ROWS)
            assert all(k // c.split_k >= c.block_k for c in cands)
    records = [
        {"shape": s, "rows": 1, "cublas_us": 10.0, "best_us": 8.0, "weight_bytes": n * k * 2}
        for s, (n, k) in bench_linear.SHAPES.items()
    ]
    (proj,) = bench_linear.projection(records, (1,))
    assert proj["cublas_us"] == pytest.approx(10.0 * (4 * 36 + 1))
    assert proj["saved_us"] == pytest.approx(2.0 * (4 * 36 + 1))


QWEN3_8B_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN3_8B_SHAPES)
@pytest.mark.parametrize("num_rows", [1, 3, 8, 16])
def test_gpu_model_shapes(n, k, num_rows):
    """Every candidate launch of the benchmark against F.linear in bf16 at the model's shapes."""
    x, w, _ = _inputs(num_rows, n, k, torch.bfloat16, seed=n + num_rows, with_bias=False)
    ref = torch.nn.functional.linear(x, w).float()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in [*bench_linear.candidates(n, k, num_rows, num_sms)[:4], None]:
        out = skinny_linear(x, w, None, cfg).float()
        assert (out - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("last_reduces", [True, False])
def test_gpu_graph_capture_with_split_and_bias(last_reduces):
    """A split-K launch with bias replays from a CUDA graph with the eager result, bit for bit,
    replay after replay (the in-kernel reduction resets its counters)."""
    x, w, bias = _inputs(4, 4096, 4096, torch.bfloat16, seed=3, with_bias=True)
    cfg = SkinnyConfig(64, 256, 8, 4, 3, True, last_reduces)
    eager = skinny_linear(x, w, bias, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear(x, w, bias, cfg)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
