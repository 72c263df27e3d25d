"""y = x @ W^T for 1-16 rows of x: a Triton kernel built for weight bandwidth.

At decode sizes a linear layer reads every weight once and does almost no arithmetic per byte,
so its time is the weight bytes over the memory bandwidth. The kernel is laid out for that:
- grid (N / BLOCK_N, SPLIT_K): each program streams [BLOCK_N, BLOCK_K] tiles of W along K (the
  contiguous dimension: coalesced 16-byte loads) and re-reads the few rows of x (L2-resident);
- the products go through `tl.dot` with the rows padded to 16 (W as the wide operand), or, for
  1-2 rows, through fp32 multiply-adds and a reduction over K (`use_dot=False`), which skips
  the shared-memory staging of the dot path;
- split-K when N / BLOCK_N programs would leave SMs idle: each split writes fp32 partial sums;
  the split that finishes a column tile last adds them in split order, adds the bias and casts
  (`last_reduces`), or a second small kernel does. Both sum in a fixed order, so results do not
  vary run to run (fp32 atomics would). Accumulation is fp32; output has x's dtype.
The model reaches the kernel through `linear`, only for the shapes and row counts of `TUNED`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arch import pdl_options

MAX_ROWS = 16  # the kernel's row limit; more rows go to cuBLAS
DOT_ROWS = 16  # tl.dot needs at least 16 along each dimension: rows are padded to this
_REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output features (rows of W) per program
    block_k: int  # K elements per loaded tile
    split_k: int  # programs along K; 1 = no partial buffer, no reduction
    num_warps: int
    num_stages: int
    use_dot: bool  # tensor-core dot (rows padded to 16) or fp32 multiply-add and reduction
    # split-K reduction by the last split of each column tile (one launch) instead of a
    # second kernel; falls back to the second kernel while capturing before the tile counters
    # of the weight exist
    last_reduces: bool = True

    @property
    def name(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        reduce = "" if self.split_k == 1 else ("l" if self.last_reduces else "r")
        return (
            f"{kind}_n{self.block_n}_k{self.block_k}_s{self.split_k}{reduce}"
            f"_w{self.num_warps}_p{self.num_stages}"
        )


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    num_rows,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    LAST_REDUCES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH_TILES: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_start = pid_k * k_per_split
    n_mask = offs_n < N
    m_mask = offs_m < num_rows
    if USE_PDL:
        # The weight never changes, so its first tiles may be pulled into L2 while the kernel
        # before is still finishing; x, the partial buffer, the tile counters and out are
        # touched only after the wait (a counter still being reset by the previous launch on
        # this weight, a reused buffer still being read).
        _prefetch_weight_l2(
            w_ptr, offs_n, N, k_start, K, stride_wn, BLOCK_N, BLOCK_K, PREFETCH_TILES
        )
        tl.extra.cuda.gdc_wait()
    # [BLOCK_N, BLOCK_K] tile of W, K contiguous; int64 offsets: lm_head has 622M elements.
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BLOCK_M, BK]
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x_mask = m_mask[:, None]
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k_start + k + offs_k) < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        else:
            prod = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            acc += tl.sum(prod, axis=2)  # [BLOCK_M, BLOCK_N]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_PDL:
        # After the last weight load: the next kernel launches only once every program got
        # here (or exited), so its programs never take an SM from a tile of this grid that
        # still has to stream its weights; they overlap the stores and the reduction.
        tl.extra.cuda.gdc_launch_dependents()
    if USE_DOT:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if WRITE_PARTIAL:
        part_ptrs = part_ptr + (pid_k * num_rows + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=out_mask)
        if LAST_REDUCES:
            # The split that finishes a column tile last adds the tile's partials in split
            # order (a fixed order, so deterministic) and resets the tile's counter for the
            # next launch. The barrier puts every thread's partial before the release.
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            num_splits = tl.num_programs(1)
            if done == num_splits - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                tile_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
                for s in range(0, num_splits):
                    # .cg: read at L2, where the other programs' stores are visible.
                    total += tl.load(
                        tile_ptrs + s * num_rows * N, mask=out_mask, other=0.0, cache_modifier=".cg"
                    )
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
                    total += bias.to(tl.float32)[None, :]
                out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _prefetch_weight_l2(
    w_ptr,
    offs_n,
    N,
    k_start,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
):
    """Pulls the first TILES [BLOCK_N, BLOCK_K] tiles of W from k_start on into L2: one
    prefetch per 32-byte sector, addresses clamped into W (a clamped one repeats a sector)."""
    sector: tl.constexpr = 256 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements
    rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn  # [BLOCK_N]
    offs_s = tl.arange(0, BLOCK_K // sector) * sector  # [BLOCK_K / sector]
    for t in tl.static_range(TILES):
        cols = tl.minimum(k_start + t * BLOCK_K + offs_s, K - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
            "=r,l",
            [w_ptr + rows[:, None] + cols[None, :]],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _reduce_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the partials are the split launch's output
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same sum on every run
        total += tl.load(part_ptr + (s * num_rows + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        # A few programs, all resident: the next kernel may launch once the loads are issued.
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def k_per_split(k: int, block_k: int, split_k: int) -> int:
    """K elements per split: a multiple of block_k covering K in at most split_k pieces."""
    return triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x @ weight^T (+ bias) -> [M, N] in x's dtype, accumulated in fp32.

    The grid is fixed by the shapes and buffers come from torch's caching allocator, so a launch
    can be captured in a CUDA graph. A weight's tile counters (`last_reduces`, int32 per column
    tile, reset by the split that reduces) are created on its first launch outside a capture; a
    capture that comes first takes the second-kernel reduction. Two streams must not run the
    same weight's split launches at the same time. Under programmatic dependent launch (sm90+,
    `kernels.arch.pdl_options`) a launch may start while the kernel before it finishes: it pulls
    its first weight tiles into L2, then waits for that kernel before it reads x or touches the
    partials, the tile counters or out, and lets the next kernel launch once its weights are
    streamed; a launch thus ends only after the one before it.
    """
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K] and weight [N, K]"
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"K mismatch: x {tuple(x.shape)} weight {tuple(weight.shape)}"
    assert 1 <= num_rows <= MAX_ROWS, f"1..{MAX_ROWS} rows, got {num_rows}"
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "K must be contiguous"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    cfg = config or choose_config(n, k, num_rows, _num_sms(x.device))
    block_m = DOT_ROWS if cfg.use_dot else triton.next_power_of_2(num_rows)
    assert block_m >= num_rows, f"{cfg.name} cannot take {num_rows} rows"
    per_split = k_per_split(k, cfg.block_k, cfg.split_k)
    num_splits = triton.cdiv(k, per_split)  # the last splits may be empty when K is small
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)  # [M, N]
    split = num_splits > 1
    # [num_splits, M, N] fp32 partial sums; from the caching allocator, so graph-capture safe.
    part = (
        torch.empty((num_splits, num_rows, n), dtype=torch.float32, device=x.device)
        if split
        else out
    )
    bias_arg = bias if bias is not None else out
    counters = _tile_counters(weight) if split and cfg.last_reduces else None
    last_reduces = counters is not None
    grid = (triton.cdiv(n, cfg.block_n), num_splits)
    pdl = pdl_options(x.device)
    _skinny_linear_kernel[grid](
        x,
        weight,
        bias_arg,
        out,
        part,
        counters if last_reduces else out,
        num_rows,
        n,
        k,
        per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot,
        WRITE_PARTIAL=split,
        LAST_REDUCES=last_reduces,
        HAS_BIAS=bias is not None and (last_reduces or not split),
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % per_split == 0,
        # the tiles the pipelined loop loads first (fixed per config: no extra variants)
        PREFETCH_TILES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if split and not last_reduces:
        _reduce_splits_kernel[(triton.cdiv(n, _REDUCE_BLOCK), num_rows)](
            part,
            bias_arg,
            out,
            num_rows,
            n,
            out.stride(0),
            SPLIT_K=num_splits,
            BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
            num_warps=4,
            **pdl,
        )
    return out


# One zeroed int32 counter per column tile of a weight (sized for the smallest tile, 16), kept
# per weight so that launches on different streams with different weights never share one.
# Each launch leaves its counters at zero again.
_COUNTERS: dict[tuple[int, int, int], torch.Tensor] = {}


def _tile_counters(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's tile counters; None while a CUDA graph is being captured before they exist
    (a zero-fill inside the capture would run only on replay), so that launch reduces with the
    second kernel."""
    key = (weight.device.index or 0, weight.data_ptr(), weight.shape[0])
    counters = _COUNTERS.get(key)
    if counters is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(
            triton.cdiv(weight.shape[0], 16), dtype=torch.int32, device=weight.device
        )
        _COUNTERS[key] = counters
    return counters


def skinny_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """The same product in fp32 through torch, cast back to x's dtype. -> [M, N]"""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# Configs per (N, K) and row bucket where the kernel beats every torch variant on the GPUs of
# `TUNED_FAMILY` (`hipfire-bench linear`; each entry's timings are in docs/perf/linear.md and
# docs/perf/linear-qwen3-0.6b.md): the Qwen3-8B projections and LM head, then those of a
# Qwen3-0.6B-shaped draft model. Other GPU families keep torch; shapes not listed take the rule
# in choose_config.
TUNED_FAMILY = "hopper"
TUNED: dict[tuple[int, int, int], SkinnyConfig] = {
    (6144, 4096, 1): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (6144, 4096, 2): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (6144, 4096, 4): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (6144, 4096, 8): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (6144, 4096, 16): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (4096, 4096, 1): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (4096, 4096, 2): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (4096, 4096, 4): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (4096, 4096, 8): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (4096, 4096, 16): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (24576, 4096, 1): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (24576, 4096, 2): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (24576, 4096, 4): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (24576, 4096, 8): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (24576, 4096, 16): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (4096, 12288, 1): SkinnyConfig(64, 128, 4, 4, 4, True, True),
    (4096, 12288, 2): SkinnyConfig(64, 128, 4, 4, 4, True, True),
    (4096, 12288, 4): SkinnyConfig(64, 128, 4, 4, 4, True, True),
    (4096, 12288, 8): SkinnyConfig(64, 128, 4, 4, 4, True, True),
    (4096, 12288, 16): SkinnyConfig(64, 256, 2, 4, 3, True, False),
    (151936, 4096, 1): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 4096, 2): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 4096, 4): SkinnyConfig(128, 256, 1, 8, 3, True, True),
    (151936, 4096, 8): SkinnyConfig(128, 256, 1, 8, 3, True, True),
    (151936, 4096, 16): SkinnyConfig(128, 256, 1, 8, 3, True, True),
    # Qwen3-0.6B-shaped draft model
    (4096, 1024, 1): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (4096, 1024, 2): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (4096, 1024, 4): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (4096, 1024, 8): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (4096, 1024, 16): SkinnyConfig(64, 256, 1, 4, 3, True, True),
    (1024, 2048, 1): SkinnyConfig(64, 256, 4, 4, 3, True, False),
    (1024, 2048, 2): SkinnyConfig(64, 256, 4, 4, 3, True, True),
    (1024, 2048, 4): SkinnyConfig(64, 256, 4, 4, 3, True, True),
    (1024, 2048, 8): SkinnyConfig(64, 256, 4, 4, 3, True, True),
    (1024, 2048, 16): SkinnyConfig(64, 256, 4, 4, 3, True, False),
    (6144, 1024, 1): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (6144, 1024, 2): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (6144, 1024, 4): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (6144, 1024, 8): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (6144, 1024, 16): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (1024, 3072, 1): SkinnyConfig(64, 256, 8, 4, 3, True, True),
    (1024, 3072, 2): SkinnyConfig(64, 256, 8, 4, 3, True, True),
    (1024, 3072, 4): SkinnyConfig(64, 256, 8, 4, 3, True, True),
    (1024, 3072, 8): SkinnyConfig(64, 256, 8, 4, 3, True, True),
    (1024, 3072, 16): SkinnyConfig(64, 256, 4, 4, 3, True, False),
    (151936, 1024, 1): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 1024, 2): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 1024, 4): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 1024, 8): SkinnyConfig(64, 128, 1, 4, 4, True, True),
    (151936, 1024, 16): SkinnyConfig(64, 128, 1, 4, 4, True, True),
}
_TUNED_HERE: dict[tuple[str, int | None], bool] = {}


def tuned_here(device: torch.device) -> bool:
    """Whether `TUNED` holds for this device's GPU family (the interpreter: always, so the
    dispatch is testable on a CPU)."""
    key = (device.type, device.index)
    here = _TUNED_HERE.get(key)
    if here is None:
        from kernels.arch import arch_config, is_interpreter

        here = is_interpreter() or (
            device.type == "cuda" and arch_config(device).family == TUNED_FAMILY
        )
        _TUNED_HERE[key] = here
    return here


ROW_BUCKETS = (1, 2, 4, 8, 16)


def row_bucket(num_rows: int) -> int:
    return next(b for b in ROW_BUCKETS if num_rows <= b)


def fill_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Smallest power-of-two split that puts at least one program on every SM (at least two
    tiles of K per split)."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < num_sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def wave_split(n: int, k: int, block_n: int, block_k: int, slots: int) -> int:
    """The power-of-two split (at most 16, at least two tiles of K each) whose grid fills its
    last wave of `slots` concurrent programs best; the smaller split within 2%."""
    programs = triton.cdiv(n, block_n)
    best, best_fill = 1, 0.0
    split = 1
    while True:
        total = programs * split
        fill = total / (triton.cdiv(total, slots) * slots)
        if fill > best_fill + 0.02:
            best, best_fill = split, fill
        if split >= 16 or k // (split * 2) < 2 * block_k:
            return best
        split *= 2


def choose_config(n: int, k: int, num_rows: int, num_sms: int) -> SkinnyConfig:
    """The table's entry for this shape (measured: it wins over the rule), else `rule_config`."""
    tuned = TUNED.get((n, k, row_bucket(num_rows)))
    if tuned is not None:
        return tuned
    return rule_config(n, k, num_rows, num_sms)


def rule_config(n: int, k: int, num_rows: int, num_sms: int) -> SkinnyConfig:
    """Dot tiles of 64 x 256 in 4 warps and 3 stages (32 KB of W per stage, 120 KB of shared
    memory: one program per SM), fp32 multiply-add tiles of 32 x 256 for a single row (no
    shared-memory stages: several programs per SM), split-K for the fullest last wave."""
    if num_rows > 1:
        split = wave_split(n, k, 64, 256, num_sms)
        return SkinnyConfig(64, 256, split, 4, 3, True)
    split = wave_split(n, k, 32, 256, 4 * num_sms)
    return SkinnyConfig(32, 256, split, 4, 2, False)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or not torch.cuda.is_available():
        return 8  # the interpreter: any small count
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """F.linear, with the skinny kernel where `TUNED` holds a winning config for the weight's
    shape and the row count (contiguous fp16/bf16, 1-16 rows); everything else goes to torch.
    -> [M, N]"""
    num_rows = x.shape[0] if x.dim() == 2 else 0
    if (
        1 <= num_rows <= MAX_ROWS
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or bias.is_contiguous())
    ):
        cfg = TUNED.get((weight.shape[0], weight.shape[1], row_bucket(num_rows)))
        if cfg is not None and tuned_here(x.device):
            return skinny_linear(x, weight, bias, cfg)
    return torch.nn.functional.linear(x, weight, bias)
