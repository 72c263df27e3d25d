"""The FP8 (W8A16) skinny GEMM against its torch reference in Triton's interpreter (fp16/fp32,
tiny shapes: ragged N and K, 1-16 rows, split-K on and off, bias, the weight read as float8 and
as bytes decoded in the kernel, every finite e4m3 code), the launch rules, the compile check of
the Hopper, RDNA3/RDNA4 and default table entries; on a GPU (marked `gpu`) the bf16 kernels at
the Qwen3-8B projections' shapes and `Fp8Linear`'s routing: the skinny kernel up to 16 rows,
`torch._scaled_mm` past them."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels.arch import num_compute_units
from kernels.fp8_linear import (
    FP8_TILES,
    SKINNY_MAX_ROWS,
    Fp8SkinnyConfig,
    fp8_linear,
    fp8_linear_ref,
    fp8_skinny,
    fp8_tiles,
    quantize_rows,
    quantize_rows_ref,
    skinny_config,
)
from tests.kernels.sm90 import run_compile_check, triton_backends

FP8 = torch.float8_e4m3fn
NAN_CODES = (0x7F, 0xFF)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter
# fp32 x: exact multiply-adds in the interpreter; NVIDIA's dots run fp32 in TF32 (10 bits)
FP32_TOL = 1e-5 if DEVICE == "cpu" else 3e-3


def _weight(n: int, k: int, seed: int, device=DEVICE):
    """(float8 [N, K] of random finite codes, every exponent and subnormals included; float32
    scales [N] that bring its rows to about unit range)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    codes[(codes == NAN_CODES[0]) | (codes == NAN_CODES[1])] = 0
    weight = codes.to(torch.uint8).view(FP8)
    scale = torch.rand((n,), generator=gen) * 2e-3 + 1e-3
    return weight.to(device), scale.to(device)


def _inputs(rows: int, k: int, n: int, dtype, seed: int, bias: bool, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, k), generator=gen).to(dtype).to(device)
    b = torch.randn((n,), generator=gen).to(dtype).to(device) if bias else None
    return x, b


def _close(out, ref, tol: float):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("decode_bits", [False, True], ids=["float8", "bytes"])
def test_every_finite_code_reads_exactly(decode_bits):
    """One-hot rows of x pick single weights: the output is W^T itself, every finite code of
    a 16 x 16 weight, unit scales, fp32 multiply-adds (exact). The two NaN codes are zeroed: a
    GPU converts them to NaN, and 0 x NaN in the sum over K would spoil their whole column."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[list(NAN_CODES)] = 0
    weight = codes.to(torch.uint8).reshape(16, 16).view(FP8).to(DEVICE)
    x = torch.eye(16, dtype=torch.float32, device=DEVICE)
    scale = torch.ones(16, device=DEVICE)
    cfg = Fp8SkinnyConfig(16, 16, 1, 4, 1, False)
    out = fp8_skinny(x, weight, scale, None, cfg, decode_bits)  # [16 (k), 16 (n)]
    want = weight.float().t()
    assert not want.isnan().any() and len(set(codes.tolist())) == 256 - len(NAN_CODES)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


SKINNY = (
    Fp8SkinnyConfig(16, 32, 1, 4, 1, True),  # no split, dot
    Fp8SkinnyConfig(32, 32, 3, 4, 1, False),  # split-K, ragged last split, multiply-add
    Fp8SkinnyConfig(16, 64, 2, 4, 1, True),  # split-K, dot
    Fp8SkinnyConfig(64, 32, 1, 4, 1, False),  # one ragged N tile, multiply-add
)
ROWS = [(1, torch.float32, True), (2, torch.float16, False), (5, torch.float16, True)]
ROWS += [(11, torch.float32, False), (16, torch.float16, True), (40, torch.float16, False)]


@pytest.mark.parametrize("cfg", SKINNY, ids=str)
@pytest.mark.parametrize(("rows", "dtype", "bias"), ROWS)
@pytest.mark.parametrize("decode_bits", [False, True], ids=["float8", "bytes"])
def test_skinny_matches_reference(cfg, rows, dtype, bias, decode_bits):
    n, k = 40, 176  # N not a tile multiple; K not a multiple of 32 or 64
    weight, scale = _weight(n, k, seed=rows)
    x, b = _inputs(rows, k, n, dtype, seed=rows + 1, bias=bias)
    out = fp8_skinny(x, weight, scale, b, cfg, decode_bits)
    _close(out, fp8_linear_ref(x, weight, scale, b), FP32_TOL if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_dispatch_runs_the_family_settings(rows):
    weight, scale = _weight(48, 256, seed=3)
    x, b = _inputs(rows, 256, 48, torch.float16, seed=4, bias=rows == 2)
    _close(fp8_linear(x, weight, scale, b), fp8_linear_ref(x, weight, scale, b), 2e-3)


def test_launch_rules():
    hopper = FP8_TILES["hopper"]
    assert not hopper.decode_bits  # sm_90 converts e4m3 in hardware
    one = skinny_config(hopper, 6144, 4096, 1, 132)
    assert one.use_dot and one.split_k == 4  # 96 column tiles x 4 >= 2 per SM
    assert skinny_config(hopper, 4096, 4096, 16, 132).split_k == 8
    assert skinny_config(hopper, 24576, 4096, 8, 132).split_k == 1
    assert skinny_config(hopper, 4096, 12288, 1, 132).split_k == 8
    default = FP8_TILES["default"]
    assert default.decode_bits and FP8_TILES["rdna3"].decode_bits and FP8_TILES["rdna4"].decode_bits
    assert not skinny_config(default, 4096, 4096, 2, 40).use_dot  # two rows: multiply-adds
    assert skinny_config(default, 4096, 4096, 3, 40).use_dot
    assert fp8_tiles(torch.device("cpu")) is default
    assert {"hopper", "rdna3", "rdna4", "default"} <= set(FP8_TILES)


def test_reference_takes_the_wrappers_arguments():
    assert inspect.signature(fp8_linear) == inspect.signature(fp8_linear_ref)


@pytest.mark.skipif(
    not {"nvidia", "amd"} <= triton_backends(), reason="Triton without both backends"
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_hopper_rdna_and_default_entries_compile():
    out = run_compile_check("tests.kernels.fp8_compile")
    assert out.count("ok ") == 15, out


# --- GPU -------------------------------------------------------------------------------------

# Qwen3-8B's fused projections (N, K): qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _gpu_layer(n: int, k: int, seed: int):
    """(float8 [N, K], float32 [N]) quantized per output channel from a random bf16 weight, as
    the loader's per-channel layer holds it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn((n, k), generator=gen, device="cuda") * k**-0.5
    scale = (w.abs().amax(1) / 448.0).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-448.0, 448.0).to(FP8), scale.float().contiguous()


def _gpu_x(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((rows, k), generator=gen, device="cuda").to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 33, 64])
def test_gpu_bf16_matches_the_reference(n, k, rows):
    weight, scale = _gpu_layer(n, k, seed=n + k)
    x = _gpu_x(rows, k, seed=rows)
    bias = _gpu_x(1, n, seed=7)[0] if rows == 3 else None
    out = fp8_linear(x, weight, scale, bias)
    ref = fp8_linear_ref(x, weight, scale, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _close(out, ref, 1e-2)  # bf16 output: 8 mantissa bits


@pytest.mark.gpu
@pytest.mark.parametrize("decode_bits", [False, True], ids=["float8", "bytes"])
def test_gpu_both_weight_reads_match(decode_bits):
    """The device family's tiles with the weight read either way: the byte decode is what the
    families without FP8 conversions run, here checked on real hardware."""
    tiles = fp8_tiles(torch.device("cuda"))
    if not decode_bits and tiles.decode_bits:
        pytest.skip("this GPU family has no e4m3 conversion: it reads the weight as bytes")
    n, k = 4096, 4096
    weight, scale = _gpu_layer(n, k, seed=11)
    x = _gpu_x(4, k, seed=12)
    cfg = skinny_config(tiles, n, k, 4, num_compute_units(x.device))
    out = fp8_skinny(x, weight, scale, None, cfg, decode_bits)
    _close(out, fp8_linear_ref(x, weight, scale), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "skinny"), [((1,), True), ((16,), True), ((2, 8), True),
                                               ((17,), True), ((64,), True), ((65,), False),
                                               ((4, 32), False)])  # fmt: skip
def test_gpu_fp8_linear_routes_by_rows(monkeypatch, shape, skinny):
    """Up to 64 rows (leading dimensions flattened) take the W8A16 kernel, more take the W8A8
    `torch._scaled_mm` product; both track the dequantized weight."""
    from executor.quant import fp8
    from kernels import fp8_linear as kernel

    calls = []
    real_kernel, real_mm = kernel.fp8_linear, fp8.scaled_mm_linear

    def spy_kernel(*args, **kwargs):
        calls.append("skinny")
        return real_kernel(*args, **kwargs)

    def spy_mm(*args, **kwargs):
        calls.append("scaled_mm")
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(kernel, "fp8_linear", spy_kernel)
    monkeypatch.setattr(fp8, "scaled_mm_linear", spy_mm)
    n, k = 6144, 4096
    weight, scale = _gpu_layer(n, k, seed=5)
    layer = fp8.Fp8Linear(weight, scale, torch.bfloat16)
    rows = 1
    for d in shape:
        rows *= d
    x = _gpu_x(rows, k, seed=6).reshape(*shape, k)
    out = layer(x, None, kernels=True)
    assert calls == ["skinny" if skinny else "scaled_mm"]
    assert out.shape == (*shape, n) and out.dtype == torch.bfloat16
    assert (rows <= SKINNY_MAX_ROWS) == skinny
    ref = x.reshape(rows, k).float() @ layer.dequantize().float().t()
    rel = (out.reshape(rows, n).float() - ref).norm(dim=1) / ref.norm(dim=1)
    # W8A16 rounds only the bf16 output; W8A8 also the activations to e4m3 (3 mantissa bits)
    assert rel.max().item() < (1e-2 if skinny else 0.05), rel.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_torch(dtype):
    """Per-token scales and codes of the fused kernel against torch's ops: ragged K (two
    steps of 1024 and a partial one), a zero row (the scale floor), a row far larger."""
    x = torch.randn((4, 2500), generator=torch.Generator().manual_seed(9)).to(dtype)
    x[1] = 0.0
    x[2] *= 300.0
    x = x.to(DEVICE)
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    got, want = q.float(), want_q.float()
    diff = (got - want).abs()
    if DEVICE == "cpu":
        # Triton's interpreter casts fp32 to e4m3 wrongly where rounding carries into the
        # exponent (124.8 becomes 64, not 128): about 2% of these values; a GPU rounds as
        # torch does. The product never runs this kernel without a GPU.
        assert (diff > 0).float().mean() < 0.05
        return
    # the same codes or a neighbour (near ties: the kernel's division may round differently)
    assert (diff > 0).float().mean() < 1e-3
    assert (diff <= torch.maximum(want.abs() / 8, torch.full_like(want, 2**-9)) + 1e-7).all()
