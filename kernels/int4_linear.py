"""y = x @ W^T with W held as 4-bit integers (W4A16): the weight is dequantized inside the GEMM.

One packed layout for every format the loader accepts (GPTQ, AWQ and compressed-tensors are
converted to it at load): `qweight` int32 [K / 8, N], nibble i of row r holding W[n, 8 r + i]
(0..15); `scales` [G, N] in x's dtype and `zeros` uint8 [G, N], G groups along K; the weight is
(q - zero) * scale of its group, the group of input k being `g_idx[k]` (act-order) or
k // group_size. Two kernels share the dequantization of a [BLOCK_K, BLOCK_N] tile (each packed
int32 loaded once and split into its 8 nibbles, fp32 scale, cast to x's dtype, so tl.dot runs on
the matrix units):
- `int4_skinny` for 1-16 rows: grid (N / BLOCK_N, SPLIT_K), the weight streamed once along K,
  split-K (fp32 partials summed in split order by kernels/split_reduce.py: deterministic,
  the bias added in the same launch) when the N tiles alone leave
  compute units idle; 1-2 rows use fp32 multiply-adds instead of a dot padded to 16 rows;
- `int4_tiled` for more rows: [BLOCK_M, BLOCK_N] output tiles in grouped order (programs that
  read the same weight columns run together, so the packed tiles are L2 hits).
Launch settings per GPU family are in `INT4_TILES`: Hopper's skinny tile from the sweep of
`hipfire-bench quant-linear` (docs/perf/quant-linear.md), the rest only compile-checked
(tests/kernels/int4_compile.py). Accumulation is fp32; the output has x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.arch import arch_config, launch_options, num_compute_units
from kernels.split_reduce import reduce_splits

SKINNY_MAX_ROWS = 16
DOT_ROWS = 16  # tl.dot needs 16 along each dimension: skinny dot tiles pad the rows to this


@dataclass(frozen=True)
class Int4SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool


@dataclass(frozen=True)
class Int4TiledConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # M tiles run together over one column of N tiles
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Int4Tiles:
    """A GPU family's launch settings; the split of a skinny launch follows from the shape."""

    skinny: Int4SkinnyConfig = Int4SkinnyConfig(32, 64, 1, 4, 1, True)
    fma_rows: int = 2  # rows up to which the skinny kernel multiplies-adds instead of tl.dot
    tiled: Int4TiledConfig = Int4TiledConfig(32, 32, 32, 8, 4, 1)
    waves_per_eu: int = 0  # AMD occupancy hint


INT4_TILES: dict[str, Int4Tiles] = {
    # skinny: 128 x 128 dot tiles, three stages, at every row count (the least summed time
    # over Qwen3-8B's projections at 1 and 16 rows in the H200 sweep, docs/perf/quant-linear.md;
    # a 64 x 128 multiply-add tile is 6% faster at one row); tiled: wgmma wants 64-row
    # multiples, and 227 KB of shared memory holds three stages of 128 x 128 outputs with
    # 64-deep K tiles.
    "hopper": Int4Tiles(
        skinny=Int4SkinnyConfig(128, 128, 1, 4, 3, True),
        fma_rows=0,
        tiled=Int4TiledConfig(128, 128, 64, 8, 8, 3),
    ),
    "ampere_ada": Int4Tiles(
        skinny=Int4SkinnyConfig(64, 128, 1, 4, 2, True),
        tiled=Int4TiledConfig(64, 128, 64, 8, 4, 2),
    ),
    # wave64, MFMA, 64 KB LDS.
    "cdna3": Int4Tiles(
        skinny=Int4SkinnyConfig(64, 128, 1, 4, 2, True),
        tiled=Int4TiledConfig(64, 128, 64, 8, 4, 2),
        waves_per_eu=2,
    ),
    # wave32 WMMA (16 x 16 x 16), 64 KB LDS: 64 x 64 tiles in four waves, two stages.
    "rdna3": Int4Tiles(
        skinny=Int4SkinnyConfig(64, 64, 1, 4, 2, True),
        tiled=Int4TiledConfig(64, 64, 32, 8, 4, 2),
        waves_per_eu=2,
    ),
    "rdna4": Int4Tiles(
        skinny=Int4SkinnyConfig(64, 64, 1, 4, 2, True),
        tiled=Int4TiledConfig(64, 64, 32, 8, 4, 2),
        waves_per_eu=2,
    ),
    "default": Int4Tiles(),
}


@triton.jit
def _dequant_tile(
    qw_ptr, s_ptr, z_ptr, g_ptr, kk, k_mask, offs_n, n_mask, N, K, group_size, k0,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GIDX: tl.constexpr,
    SCALE_ROW: tl.constexpr,
):
    """The fp32 weight tile W^T[kk, offs_n] -> [BLOCK_K, BLOCK_N]. SCALE_ROW: the whole tile
    lies in one group (K tiles aligned inside groups), so one row of scales and zeros serves it."""
    mask = k_mask[:, None] & n_mask[None, :]
    # each packed int32 is loaded once and split into its 8 nibbles (inputs 8 r .. 8 r + 7)
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]; k0 is a multiple of 8
    packed = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :],
                     mask=(rows * 8 < K)[:, None] & n_mask[None, :], other=0)  # fmt: skip
    nibbles = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))  # [BLOCK_K, BLOCK_N] int32, row 8 r + i
    if SCALE_ROW:
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.int32)[None, :]
    else:
        if HAS_GIDX:
            g = tl.load(g_ptr + kk, mask=k_mask, other=0).to(tl.int64)
        else:
            g = (kk // group_size).to(tl.int64)
        offs = g[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.int32)
    return (q - z).to(tl.float32) * s


@triton.jit(do_not_specialize=["num_rows"])
def _int4_skinny_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    num_rows, N, K, k_per_split, group_size, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, HAS_GIDX: tl.constexpr, SCALE_ROW: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_mask = offs_n < N
    m_mask = offs_m < num_rows
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, kk, k_mask, offs_n, n_mask, N, K,
                          group_size, k0, BLOCK_K, BLOCK_N, HAS_GIDX, SCALE_ROW)  # fmt: skip
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        if USE_DOT:
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)  # [BLOCK_M, BLOCK_N]
        else:
            w = w.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the dot path's
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        part_ptrs = out_ptr + (pid_k * num_rows + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _int4_tiled_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, group_size, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_GIDX: tl.constexpr, SCALE_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, kk, k_mask, offs_n, n_mask, N, K,
                          group_size, k0, BLOCK_K, BLOCK_N, HAS_GIDX, SCALE_ROW)  # fmt: skip
        x = tl.load(x_ptr + x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check(x, qweight, scales, zeros, g_idx, group_size, bias) -> tuple[int, int, int]:
    assert x.dim() == 2 and x.stride(1) == 1, "x [M, K] with K contiguous"
    num_rows, k = x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert qweight.dtype == torch.int32 and qweight.is_contiguous()
    assert qweight.shape[0] * 8 == k, f"qweight {tuple(qweight.shape)} packs K={k} as [K/8, N]"
    n = qweight.shape[1]
    assert scales.dtype == x.dtype and scales.is_contiguous() and scales.shape[1] == n
    assert zeros.dtype == torch.uint8 and zeros.shape == scales.shape and zeros.is_contiguous()
    if g_idx is None:
        assert scales.shape[0] * group_size == k, "one group per group_size inputs"
    else:
        assert g_idx.shape == (k,) and g_idx.dtype == torch.int32 and g_idx.is_contiguous()
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    return num_rows, n, k


def _scale_row(g_idx, group_size: int, block_k: int) -> bool:
    return g_idx is None and group_size % block_k == 0


def fill_split(n: int, k: int, block_n: int, block_k: int, num_units: int) -> int:
    """Smallest power-of-two split (at most 16, two K tiles per split at least) that puts two
    programs on every compute unit."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 2 * num_units and split < 16 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def int4_skinny(x, qweight, scales, zeros, g_idx, group_size, bias, config: Int4SkinnyConfig):
    """The skinny kernel with an explicit config (1-16 rows). -> [M, N] in x's dtype."""
    num_rows, n, k = _check(x, qweight, scales, zeros, g_idx, group_size, bias)
    assert 1 <= num_rows <= SKINNY_MAX_ROWS
    block_m = DOT_ROWS if config.use_dot else triton.next_power_of_2(num_rows)
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    num_splits = triton.cdiv(k, per_split)
    split = num_splits > 1
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    # [num_splits, M, N] fp32 partials, summed below in split order
    dest = out
    if split:
        dest = torch.empty((num_splits, num_rows, n), dtype=torch.float32, device=x.device)
    _int4_skinny_kernel[(triton.cdiv(n, config.block_n), num_splits)](
        x, qweight, scales, zeros, g_idx if g_idx is not None else zeros,
        bias if bias is not None else out, dest,
        num_rows, n, k, per_split, group_size, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, HAS_GIDX=g_idx is not None,
        SCALE_ROW=_scale_row(g_idx, group_size, config.block_k),
        WRITE_PARTIAL=split, HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **_amd_options(x.device),
    )  # fmt: skip
    if split:
        reduce_splits(dest, out, None, bias, _amd_options(x.device))
    return out


def int4_tiled(x, qweight, scales, zeros, g_idx, group_size, bias, config: Int4TiledConfig):
    """The tiled kernel with an explicit config (any rows). -> [M, N] in x's dtype."""
    num_rows, n, k = _check(x, qweight, scales, zeros, g_idx, group_size, bias)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _int4_tiled_kernel[grid](
        x, qweight, scales, zeros, g_idx if g_idx is not None else zeros,
        bias if bias is not None else out, out,
        num_rows, n, k, group_size, x.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, HAS_GIDX=g_idx is not None,
        SCALE_ROW=_scale_row(g_idx, group_size, config.block_k), HAS_BIAS=bias is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **_amd_options(x.device),
    )  # fmt: skip
    return out


def _amd_options(device: torch.device) -> dict:
    return launch_options(device, int4_tiles(device).waves_per_eu)


def int4_tiles(device: torch.device) -> Int4Tiles:
    return INT4_TILES.get(arch_config(device).family, INT4_TILES["default"])


def _fit_block_k(block_k: int, g_idx, group_size: int) -> int:
    """A K tile inside one group where groups are contiguous and at least 16 inputs long (one
    row of scales per tile), else the family's."""
    if g_idx is None and 16 <= group_size < block_k and block_k % group_size == 0:
        return group_size
    return block_k


def skinny_config(tiles: Int4Tiles, n: int, k: int, num_rows: int, num_units: int, g_idx,
                  group_size: int) -> Int4SkinnyConfig:  # fmt: skip
    cfg = tiles.skinny
    cfg = replace(cfg, block_k=_fit_block_k(cfg.block_k, g_idx, group_size))
    if num_rows <= tiles.fma_rows:
        cfg = replace(cfg, use_dot=False, num_stages=1)
    return replace(cfg, split_k=fill_split(n, k, cfg.block_n, cfg.block_k, num_units))


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] uint8
    g_idx: torch.Tensor | None,  # [K] int32, None: group of k is k // group_size
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """x @ dequant(W)^T (+ bias) -> [M, N]: the skinny kernel for 1-16 rows, the tiled one past
    them, with the device family's settings from `INT4_TILES`."""
    tiles = int4_tiles(x.device)
    num_rows, n, k = x.shape[0], qweight.shape[1], x.shape[1]
    if num_rows <= SKINNY_MAX_ROWS:
        cfg = skinny_config(tiles, n, k, num_rows, num_compute_units(x.device), g_idx, group_size)
        return int4_skinny(x, qweight, scales, zeros, g_idx, group_size, bias, cfg)
    cfg = replace(tiles.tiled, block_k=_fit_block_k(tiles.tiled.block_k, g_idx, group_size))
    return int4_tiled(x, qweight, scales, zeros, g_idx, group_size, bias, cfg)


def dequantize_int4(
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] uint8
    g_idx: torch.Tensor | None,  # [K]
    group_size: int,
) -> torch.Tensor:
    """The weight as the kernels see it, [N, K] in scales' dtype (fp32 math, one rounding)."""
    k = qweight.shape[0] * 8
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)  # [8]
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K / 8, 8, N]
    q = q.reshape(k, -1)  # [K, N]
    if g_idx is None:
        g = torch.arange(k, device=qweight.device) // group_size
    else:
        g = g_idx.long()
    w = (q - zeros[g].to(torch.int32)).float() * scales[g].float()  # [K, N]
    return w.to(scales.dtype).t()


def int4_linear_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] uint8
    g_idx: torch.Tensor | None,  # [K] int32
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The same product through torch: dequantize the weight, then one fp32 matmul. -> [M, N]"""
    w = dequantize_int4(qweight, scales, zeros, g_idx, group_size)  # [N, K]
    out = x.float() @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
