"""y = (x @ W^T) * scale + bias for 1-64 rows of x with W held in FP8 (W8A16, weight-only), and
the per-token FP8 quantization of activations that the W8A8 product past 64 rows needs.

The weight is float8_e4m3fn [N, K], row-major (K contiguous), with one float32 scale per output
channel [N]; x is bf16, fp16 or fp32 [M, K]. At decode sizes the product is bound by reading W
once, so the kernel streams it in FP8 (half the bytes of bf16) and never quantizes x:
- `fp8_skinny`: grid (N / BLOCK_N, SPLIT_K); each program streams [BLOCK_N, BLOCK_K] tiles of W
  along K, converts them to fp32 (exact: every e4m3 value is an fp32, bf16 and fp16 value) and
  multiplies them with the few rows of x: through `tl.dot` in x's dtype with the rows padded to
  16, 32 or 64 (W as the wide operand; fp32 x runs it in TF32 on NVIDIA, as the int4 kernel
  does), or, up to `fma_rows` rows, through fp32 multiply-adds. The scale multiplies each
  output column once, after the sum over K; then the bias is added and the result cast to x's
  dtype;
- split-K when the N tiles alone leave compute units idle (`fill_split`, as the int4 kernel):
  each split writes fp32 partial sums and `kernels/split_reduce.py` adds them in split order,
  applies the scale and the bias and casts, so results do not vary run to run.
The weight is read one of two ways, per GPU family (`Fp8Tiles.decode_bits`): as float8 and
converted by the hardware (Hopper), or as uint8 bytes decoded into fp32 by integer arithmetic
(every other family). RDNA3 has no FP8 type and CDNA3's is the fnuz variant, not e4m3fn; the
bytes are the one form every family reads alike, RDNA4 (gfx12) included. The byte decode is
exact for every finite code; the two NaN codes read as +-480, as Triton's interpreter converts
them, and quantized checkpoints hold none.
Launch settings per GPU family are in `FP8_TILES`: Hopper's from the tile sweep of
`hipfire-bench quant-linear` (docs/perf/quant-linear.md), the others only compile-checked
(tests/kernels/fp8_compile.py). More rows than `SKINNY_MAX_ROWS` go to `torch._scaled_mm`
(W8A8, `executor/quant/fp8.py`), their activations scaled to FP8 by `quantize_rows`: one
launch, one program per row (its absmax, then the scaled and rounded row), where torch's
element-wise ops took five.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options, num_compute_units
from kernels.int4_linear import fill_split
from kernels.split_reduce import reduce_splits

# W8A16 up to here: at 64 rows the weight read still bounds the product (64 x 2 FLOPs per
# weight byte), and the per-token activation quantization that W8A8 needs costs more than the
# dot tiles' conversion of W (docs/perf/quant-linear.md)
SKINNY_MAX_ROWS = 64
DOT_ROWS = 16  # tl.dot needs 16 along each dimension: dot tiles pad the rows to at least this
FP8_MAX = 448.0  # the largest finite e4m3fn value
_QUANT_BLOCK = 1024  # inputs per step of quantize_rows


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    block_n: int  # output features (rows of W) per program
    block_k: int  # K elements (bytes of W per row) per loaded tile
    split_k: int  # programs along K; 1: no partial buffer, no reduction
    num_warps: int
    num_stages: int
    use_dot: bool  # tl.dot with the rows padded to 16, or fp32 multiply-adds


@dataclass(frozen=True)
class Fp8Tiles:
    """A GPU family's launch settings; the split of a launch follows from the shape."""

    skinny: Fp8SkinnyConfig = Fp8SkinnyConfig(32, 128, 1, 4, 2, True)
    fma: Fp8SkinnyConfig = Fp8SkinnyConfig(32, 128, 1, 4, 1, False)
    fma_rows: int = 2  # rows up to which the `fma` config runs instead of `skinny`
    decode_bits: bool = True  # W read as uint8 and decoded by integer arithmetic
    waves_per_eu: int = 0  # AMD occupancy hint


FP8_TILES: dict[str, Fp8Tiles] = {
    # 64 x 128 tiles of W (8 KB per stage) in three stages, dot tiles at every row count:
    # the least summed time over Qwen3-8B's projections at 1 and 16 rows in the H200 sweep
    # (docs/perf/quant-linear.md), within 0.3% of each point's own best. sm_90 converts e4m3
    # in hardware.
    "hopper": Fp8Tiles(
        skinny=Fp8SkinnyConfig(64, 128, 1, 4, 3, True), fma_rows=0, decode_bits=False
    ),
    # wave32 WMMA (16 x 16 x 16), 64 KB LDS: 64 x 128 dot tiles in four waves, two stages.
    "rdna3": Fp8Tiles(skinny=Fp8SkinnyConfig(64, 128, 1, 4, 2, True), waves_per_eu=2),
    "rdna4": Fp8Tiles(skinny=Fp8SkinnyConfig(64, 128, 1, 4, 2, True), waves_per_eu=2),
    "default": Fp8Tiles(),
}


@triton.jit
def _e4m3_to_f32(b):
    """uint8 e4m3fn codes -> fp32. A normal code (exponent field >= 1) moves its 7 magnitude
    bits under fp32's exponent and mantissa and rebiases the exponent (7 -> 127); a subnormal
    one is its 3 mantissa bits times 2^-9, built as a float so no fp32 subnormal (which a GPU
    may flush) ever appears."""
    b = b.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    small = mag.to(tl.float32) * 0.001953125
    v = tl.where(mag < 8, small, normal)
    return tl.where(b >= 128, -v, v)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_skinny_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    num_rows, N, K, k_per_split, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DECODE_BITS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_mask = offs_n < N
    m_mask = offs_m < num_rows
    k_start = pid_k * k_per_split
    # int64 row offsets: an [N, K] weight may hold more than 2^31 bytes (an LM head)
    w_rows = offs_n.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = tl.load(w_ptr + w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        if DECODE_BITS:
            w = _e4m3_to_f32(w)  # [BLOCK_N, BLOCK_K] fp32
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        if USE_DOT:
            acc = tl.dot(w.to(x_ptr.dtype.element_ty), tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        else:
            prod = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            acc += tl.sum(prod, axis=2)  # [BLOCK_M, BLOCK_N]
    if USE_DOT:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        part_ptrs = out_ptr + (pid_k * num_rows + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=out_mask)
    else:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check(x, weight, scale, bias) -> tuple[int, int, int]:
    assert x.dim() == 2 and x.stride(1) == 1, "x [M, K] with K contiguous"
    num_rows, k = x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    n = weight.shape[0]
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} is not [N, K={k}]"
    assert scale.dtype == torch.float32 and scale.shape == (n,) and scale.is_contiguous()
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    return num_rows, n, k


def fp8_skinny(x, weight, scale, bias, config: Fp8SkinnyConfig, decode_bits: bool):
    """The skinny kernel with an explicit config (1-64 rows); `decode_bits` reads W as bytes.
    Buffers come from torch's caching allocator and the grid from the shapes, so a launch can
    be captured in a CUDA graph. -> [M, N] in x's dtype"""
    num_rows, n, k = _check(x, weight, scale, bias)
    assert 1 <= num_rows <= SKINNY_MAX_ROWS, f"1..{SKINNY_MAX_ROWS} rows, got {num_rows}"
    block_m = triton.next_power_of_2(num_rows)
    if config.use_dot:
        block_m = max(block_m, DOT_ROWS)
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    num_splits = triton.cdiv(k, per_split)
    split = num_splits > 1
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    # [num_splits, M, N] fp32 partials, reduced below in split order
    dest = out
    if split:
        dest = torch.empty((num_splits, num_rows, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scale
    options = launch_options(x.device, fp8_tiles(x.device).waves_per_eu)
    _fp8_skinny_kernel[(triton.cdiv(n, config.block_n), num_splits)](
        x, weight.view(torch.uint8) if decode_bits else weight, scale, bias_arg, dest,
        num_rows, n, k, per_split, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, DECODE_BITS=decode_bits, WRITE_PARTIAL=split,
        HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **options,
    )  # fmt: skip
    if split:
        reduce_splits(dest, out, scale, bias, options)
    return out


def fp8_tiles(device: torch.device) -> Fp8Tiles:
    return FP8_TILES.get(arch_config(device).family, FP8_TILES["default"])


def skinny_config(tiles: Fp8Tiles, n: int, k: int, num_rows: int, num_units: int):
    """The family's dot or multiply-add config for `num_rows`, split to fill the device."""
    cfg = tiles.fma if num_rows <= tiles.fma_rows else tiles.skinny
    return replace(cfg, split_k=fill_split(n, k, cfg.block_n, cfg.block_k, num_units))


def fp8_linear(
    x: torch.Tensor,  # [M, K], M <= SKINNY_MAX_ROWS
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(x @ W^T) * scale (+ bias) -> [M, N] in x's dtype for 1-64 rows, with the device
    family's settings from `FP8_TILES`."""
    tiles = fp8_tiles(x.device)
    num_rows, n, k = x.shape[0], weight.shape[0], x.shape[1]
    cfg = skinny_config(tiles, n, k, num_rows, num_compute_units(x.device))
    return fp8_skinny(x, weight, scale, bias, cfg, tiles.decode_bits)


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The same product through torch in fp32: the weight's exact values, the scale after the
    sum over K, then the bias. -> [M, N] in x's dtype"""
    out = (x.float() @ weight.float().t()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, FMAX: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FMAX, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -FMAX), FMAX)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] scaled to e4m3fn by its own absmax / 448 (at least 1e-12), as
    `quantize_rows_ref`. -> (float8 [M, K], float32 scales [M, 1])"""
    assert x.dim() == 2 and x.stride(1) == 1, "x [M, K] with K contiguous"
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_rows_kernel[(num_rows,)](
            x, q, scale, k, x.stride(0), q.stride(0), BLOCK=_QUANT_BLOCK, FMAX=FP8_MAX,
            num_warps=4,
        )  # fmt: skip
    return q, scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same per-token quantization through torch ops."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [M, 1]
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [M, K]
    return q, scale
