"""4-bit weight-only linear layers (W4A16): GPTQ, AWQ (GEMM) and compressed-tensors
pack-quantized checkpoints converted at load into the one packed layout of
`kernels.int4_linear` (qweight [K / 8, N] int32 packed along K, scales [G, N], uint8 zero
points [G, N], optional act-order g_idx [K]). The conversions only move nibbles and add the
formats' zero-point offsets, so the dequantized weight is exactly the checkpoint's.
"""

from __future__ import annotations

import torch

from executor.model_config import ModelLoadError
from executor.quant.linear import QuantLinear

_SHIFTS = tuple(range(0, 32, 4))
# AWQ's GEMM packing keeps column 8 c + AWQ_ORDER[i] in nibble i of word c
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_last(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., C] holding eight nibbles each -> int32 [..., 8 C], nibble i of word c at
    8 c + i (or at 8 c + order[i])."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    q = (packed[..., None] >> shifts) & 0xF  # [..., C, 8]
    if order is not None:
        q = q[..., [order.index(j) for j in range(8)]]
    return q.reshape(*packed.shape[:-1], -1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] of 0..15 -> int32 [K / 8, N], input 8 r + i in nibble i of row r."""
    q = q.to(torch.int32).reshape(-1, 8, q.shape[-1])  # [K / 8, 8, N]
    packed = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32, device=q.device)
    for i in range(8):
        packed |= q[:, i] << (4 * i)
    return packed


class Int4Linear(QuantLinear):
    """W [N, K] as (q - zeros[g]) * scales[g], g the group of each input."""

    def __init__(self, qweight, scales, zeros, g_idx, group_size: int):
        self.qweight = qweight.contiguous()  # [K / 8, N] int32
        self.scales = scales.contiguous()  # [G, N]
        self.zeros = zeros.contiguous()  # [G, N] uint8
        self.g_idx = None if g_idx is None else g_idx.to(torch.int32).contiguous()  # [K]
        self.group_size = group_size
        self.in_features = self.qweight.shape[0] * 8
        self.out_features = self.qweight.shape[1]
        groups = self.scales.shape[0]
        if self.qweight.dim() != 2 or self.scales.dim() != 2:
            raise ModelLoadError(
                f"int4 weight: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} "
                "must be matrices"
            )
        if self.zeros.shape != self.scales.shape or self.scales.shape[1] != self.out_features:
            raise ModelLoadError(
                f"int4 weight: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do "
                f"not fit qweight {tuple(qweight.shape)}"
            )
        if self.g_idx is None and groups * group_size != self.in_features:
            raise ModelLoadError(
                f"int4 weight: {groups} groups of {group_size} do not cover {self.in_features} "
                "inputs"
            )

    def __call__(self, x, bias=None, kernels=False):
        from kernels import int4_linear as k

        fn = k.int4_linear if kernels and x.is_cuda else k.int4_linear_ref
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        args = (self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, bias)
        return fn(x2, *args).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        from kernels.int4_linear import dequantize_int4

        return dequantize_int4(self.qweight, self.scales, self.zeros, self.g_idx, self.group_size)

    @staticmethod
    def cat(parts: list[Int4Linear]) -> Int4Linear:
        """One weight of the parts' outputs side by side (q, k, v into qkv): they share the
        input, so their groups (and act-order indices) must be the same."""
        first = parts[0]
        for p in parts[1:]:
            same_idx = (p.g_idx is None and first.g_idx is None) or (
                p.g_idx is not None
                and first.g_idx is not None
                and torch.equal(p.g_idx, first.g_idx)
            )
            if p.group_size != first.group_size or not same_idx:
                raise ModelLoadError(
                    "int4 weights that share an input (q/k/v or gate/up) have different groups "
                    "or act-order indices; such checkpoints are not supported"
                )
        return Int4Linear(
            torch.cat([p.qweight for p in parts], dim=1),
            torch.cat([p.scales for p in parts], dim=1),
            torch.cat([p.zeros for p in parts], dim=1),
            first.g_idx,
            first.group_size,
        )


def _group_index(g_idx: torch.Tensor | None, k: int, groups: int):
    """(g_idx or None when it is the plain k // group_size, group_size)."""
    group_size = k // groups
    if g_idx is None:
        return None, group_size
    g_idx = g_idx.to(torch.int32)
    plain = torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size
    return (None if torch.equal(g_idx, plain) else g_idx), group_size


def from_gptq(qweight, qzeros, scales, g_idx, zero_offset: int, dtype) -> Int4Linear:
    """GPTQ: qweight [K / 8, N] packed along K (already the kernel's layout), qzeros [G, N / 8]
    packed along N, stored minus one in the original format (`zero_offset` 1)."""
    zeros = (unpack_last(qzeros)[:, : scales.shape[1]] + zero_offset).to(torch.uint8)
    idx, group_size = _group_index(g_idx, qweight.shape[0] * 8, scales.shape[0])
    return Int4Linear(qweight, scales.to(dtype), zeros, idx, group_size)


def from_awq(qweight, qzeros, scales, dtype) -> Int4Linear:
    """AWQ GEMM: qweight [K, N / 8] and qzeros [G, N / 8] packed along N in AWQ_ORDER."""
    q = unpack_last(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_last(qzeros, AWQ_ORDER).to(torch.uint8)  # [G, N]
    group_size = q.shape[0] // scales.shape[0]
    return Int4Linear(pack_rows(q), scales.to(dtype), zeros, None, group_size)


def from_pack_quantized(packed, scale, zero_point, g_idx, dtype) -> Int4Linear:
    """compressed-tensors pack-quantized: weight_packed [N, K / 8] packed along K (so its
    transpose is the kernel's layout) holding q + 8; weight_scale [N, G]; an asymmetric
    checkpoint's weight_zero_point [N / 8, G] packed along N, also + 8; act-order weight_g_idx."""
    n = scale.shape[0]
    if zero_point is None:
        zeros = torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device)
    else:
        zeros = unpack_last(zero_point.t().contiguous()).t()[:n].to(torch.uint8)  # [N, G]
    idx, group_size = _group_index(g_idx, packed.shape[1] * 8, scale.shape[1])
    return Int4Linear(packed.t(), scale.t().to(dtype), zeros.t(), idx, group_size)
