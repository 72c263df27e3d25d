"""The int4 GEMM kernels against their torch reference in Triton's interpreter (fp16/fp32, tiny
shapes: ragged N and K, groups of 32 and 64 inputs, act-order, split-K, bias), the launch rules,
and the compile check of the Hopper and RDNA3/RDNA4 table entries."""

from __future__ import annotations

import pytest
import torch

from executor.quant.int4 import pack_rows
from kernels.int4_linear import (
    INT4_TILES,
    Int4SkinnyConfig,
    Int4TiledConfig,
    dequantize_int4,
    fill_split,
    int4_linear,
    int4_linear_ref,
    int4_skinny,
    int4_tiled,
    int4_tiles,
    skinny_config,
)
from tests.kernels.sm90 import run_compile_check, triton_backends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, group: int, act_order: bool, dtype, seed: int):
    """(qweight, scales, zeros, g_idx, q [N, K]) of a random 4-bit weight."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    groups = k // group
    scales = (torch.rand((groups, n), generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.uint8)
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32)
    dev = torch.device(DEVICE)
    qweight = pack_rows(q.t()).to(dev)
    idx = None if g_idx is None else g_idx.to(dev)
    return qweight, scales.to(dev), zeros.to(dev), idx, q


def _inputs(rows: int, k: int, n: int, dtype, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, k), generator=gen).to(dtype).to(DEVICE)
    b = torch.randn((n,), generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, b


def _close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # one output rounding of the dtype: bf16 keeps 8 significant bits, fp16 11; fp32 dots run
    # in TF32 (10 bits) on NVIDIA GPUs, exactly in the interpreter
    fp32 = 1e-4 if DEVICE == "cpu" else 3e-3
    tol = {torch.float32: fp32, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


def test_dequantize_reads_nibbles_groups_and_act_order():
    qweight, scales, zeros, g_idx, q = _weight(24, 64, 32, True, torch.float32, seed=1)
    w = dequantize_int4(qweight.cpu(), scales.cpu(), zeros.cpu(), g_idx.cpu(), 32)
    g = g_idx.cpu().long()
    expected = (q - zeros.cpu()[g].t().long()).float() * scales.cpu()[g].t()
    torch.testing.assert_close(w, expected, rtol=0, atol=0)


SKINNY = (
    Int4SkinnyConfig(16, 32, 1, 4, 1, True),
    Int4SkinnyConfig(32, 32, 3, 4, 1, False),  # split-K, ragged last split, multiply-add
    Int4SkinnyConfig(16, 64, 2, 4, 1, True),  # K tiles across groups of 32: per-input scales
)


@pytest.mark.parametrize("cfg", SKINNY, ids=str)
@pytest.mark.parametrize(
    ("rows", "dtype"), [(1, torch.float16), (3, torch.float32), (16, torch.float16)]
)
@pytest.mark.parametrize("act_order", [False, True])
def test_skinny_matches_reference(cfg, rows, dtype, act_order):
    n, k = 40, 192  # N not a tile multiple; K 6 groups of 32, not a multiple of 64
    qweight, scales, zeros, g_idx, _ = _weight(n, k, 32, act_order, dtype, seed=rows)
    x, b = _inputs(rows, k, n, dtype, seed=rows + 1, bias=rows != 3)
    args = (qweight, scales, zeros, g_idx, 32, b)
    _close(int4_skinny(x, *args, cfg), int4_linear_ref(x, *args), dtype)


@pytest.mark.parametrize(
    "cfg", [Int4TiledConfig(16, 16, 32, 2, 4, 1), Int4TiledConfig(32, 16, 64, 1, 4, 1)], ids=str
)
@pytest.mark.parametrize(
    ("dtype", "act_order", "group"), [(torch.float16, False, 64), (torch.float32, True, 32)]
)
def test_tiled_matches_reference(cfg, dtype, act_order, group):
    n, k, rows = 48, 128, 37  # ragged M tiles, grouped program order over 3 column tiles
    qweight, scales, zeros, g_idx, _ = _weight(n, k, group, act_order, dtype, seed=group)
    x, b = _inputs(rows, k, n, dtype, seed=7, bias=True)
    args = (qweight, scales, zeros, g_idx, group, b)
    _close(int4_tiled(x, *args, cfg), int4_linear_ref(x, *args), dtype)


@pytest.mark.parametrize("rows", [2, 20])
def test_dispatch_picks_a_kernel_that_matches(rows):
    qweight, scales, zeros, g_idx, _ = _weight(32, 128, 64, False, torch.float16, seed=3)
    x, _ = _inputs(rows, 128, 32, torch.float16, seed=4, bias=False)
    args = (qweight, scales, zeros, g_idx, 64, None)
    _close(int4_linear(x, *args), int4_linear_ref(x, *args), torch.float16)


def test_launch_rules():
    tiles = INT4_TILES["hopper"]
    one = skinny_config(tiles, 4096, 4096, 1, 132, None, 128)
    assert one.use_dot and one.block_k == 128  # Hopper: dot tiles at one row too
    fma = skinny_config(INT4_TILES["default"], 4096, 4096, 1, 40, None, 128)
    assert not fma.use_dot and fma.num_stages == 1  # elsewhere one row multiplies-adds
    many = skinny_config(tiles, 4096, 4096, 8, 132, None, 32)
    assert many.use_dot and many.block_k == 32  # a K tile inside each group of 32
    assert skinny_config(tiles, 4096, 4096, 8, 132, torch.zeros(1), 32).block_k == 128
    assert fill_split(4096, 4096, 64, 128, 132) == 8  # 64 column tiles x 8 >= 2 per SM
    assert fill_split(151936, 4096, 64, 128, 132) == 1
    assert int4_tiles(torch.device("cpu")) is INT4_TILES["default"]
    assert {"hopper", "rdna3", "rdna4", "cdna3", "ampere_ada", "default"} <= set(INT4_TILES)


@pytest.mark.skipif(
    not {"nvidia", "amd"} <= triton_backends(), reason="Triton without both backends"
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_hopper_and_rdna_entries_compile():
    assert run_compile_check("tests.kernels.int4_compile").count("ok ") == 12


def test_reference_takes_the_wrappers_arguments():
    import inspect

    assert inspect.signature(int4_linear) == inspect.signature(int4_linear_ref)
