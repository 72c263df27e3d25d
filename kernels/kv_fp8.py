"""FP8 KV storage: the rule every K/V writer and reader of a cache in `FP8_KV_DTYPE` follows.

An FP8 cache holds `value / scale`, clamped to e4m3's finite range before the cast, with one
float32 scale per KV head of a layer for K and one for V; a reader takes `stored * scale`. The
torch references apply the rule with `kv_store_ref` / `kv_load_ref`; the Triton kernels with
`quantize_kv` before their store, and verify attention folds the scales into its arithmetic
(a program reads one KV head: the K scale multiplies the softmax scale, the V scale the
output), which is the same product in another order. Scales are tensors, never Python floats,
so a captured graph reads them from the device like any other input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def check_kv_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """An FP8 cache [blocks, page, Hkv, D] needs both scales as float32 [Hkv] on its device;
    another cache ignores them."""
    if not is_fp8(cache.dtype):
        return
    num_kv_heads = cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s is not None, f"an fp8 KV cache needs {name}"
        assert s.shape == (num_kv_heads,) and s.dtype == torch.float32, (
            f"{name} must be float32 [{num_kv_heads}], got {s.dtype} {tuple(s.shape)}"
        )
        assert s.device == cache.device and s.stride(0) == 1, f"{name} on {s.device}"


def kv_store_ref(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [n, Hkv, D] as a cache of `dtype` stores it; scale [Hkv] float32 (FP8 only)."""
    if not is_fp8(dtype):
        return x
    return (x.float() / scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def kv_load_ref(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows [..., Hkv, D] as float32 values; scale [Hkv] float32 (FP8 only)."""
    if not is_fp8(stored.dtype):
        return stored.float()
    return stored.float() * scale[:, None]


@triton.jit
def quantize_kv(x, scale):
    """fp32 x / scale, clamped to e4m3's finite range: the store's cast then never overflows.
    The division is IEEE-rounded (`/` compiles to an approximate one on NVIDIA), as torch's in
    `kv_store_ref`, so a kernel and its reference store the same bytes from the same values."""
    return tl.minimum(tl.maximum(tl.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
