"""GGML tensor formats dequantized by torch (vectorised over blocks, on any device).

Block layouts (llama.cpp ggml-quants, little-endian), per block of `BLOCKS[type][0]` values:
- Q8_0, 32 values in 34 bytes: fp16 d, 32 int8 q; w = d * q.
- Q4_K, 256 values in 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight
  6-bit mins, 128 bytes of nibbles; sub-block s (32 values) is the low nibbles (s even) or high
  nibbles (s odd) of bytes 32 (s // 2) .. +32; w = d * scale[s] * q - dmin * min[s].
- Q6_K, 256 values in 210 bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8
  scales (one per 16 values), fp16 d; w = d * scale * (q - 32).
- F32, F16, BF16: plain little-endian values.
"""

from __future__ import annotations

import math

import torch

F32, F16, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 8, 12, 14, 30
# ggml type -> (values per block, bytes per block)
BLOCKS: dict[int, tuple[int, int]] = {
    F32: (1, 4),
    F16: (1, 2),
    BF16: (1, 2),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
    Q6_K: (256, 210),
}
NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
_CHUNK_BLOCKS = 1 << 16  # blocks dequantized at once: bounds the fp32 intermediates


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block -> [num_blocks, 1] float32."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [nb, 32]
    return _f16(blocks, 0) * q


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    nb = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [nb, 1]
    s = blocks[:, 4:16].to(torch.int32)  # [nb, 12]
    # sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 take their
    # low 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7
    scale = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    qs = blocks[:, 16:].reshape(nb, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(nb, 8, 32).float()  # [nb, 8, 32]
    w = (d * scale.float())[:, :, None] * q - (dmin * mins.float())[:, :, None]
    return w.reshape(nb, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    nb = blocks.shape[0]
    ql = blocks[:, :128].reshape(nb, 2, 64)  # two halves of 128 values
    qh = blocks[:, 128:192].reshape(nb, 2, 32)
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [nb, 16]
    d = _f16(blocks, 208)  # [nb, 1]
    # within a half: values 0-63 are the low nibbles of ql, 64-127 its high nibbles; the 2-bit
    # field at shift 2 j of qh byte l is the top of value 32 j + l
    low = torch.stack([ql & 15, ql >> 4], dim=2).reshape(nb, 2, 128)
    high = torch.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).reshape(nb, 2, 128)
    q = (low | (high << 4)).float() - 32.0  # [nb, 2, 128]
    return ((d * scale)[:, :, None] * q.reshape(nb, 16, 16)).reshape(nb, 256)


_DEQUANT = {Q8_0: _q8_0, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A tensor's bytes (uint8, its blocks in order) -> `shape` (outermost first) in `dtype`."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"ggml type {ggml_type} is not one of {', '.join(NAMES.values())}")
    block_values, block_bytes = BLOCKS[ggml_type]
    numel = math.prod(shape)
    if numel % block_values or raw.numel() != numel // block_values * block_bytes:
        raise ValueError(
            f"{NAMES[ggml_type]} tensor of shape {list(shape)}: {raw.numel()} bytes do not hold it"
        )
    raw = raw.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    if ggml_type == F32:
        return raw.view(torch.float32).reshape(shape).to(dtype)
    if ggml_type in (F16, BF16):
        half = torch.float16 if ggml_type == F16 else torch.bfloat16
        return raw.view(half).reshape(shape).to(dtype)
    out = torch.empty((raw.shape[0], block_values), dtype=dtype, device=raw.device)
    fn = _DEQUANT[ggml_type]
    for start in range(0, raw.shape[0], _CHUNK_BLOCKS):
        out[start : start + _CHUNK_BLOCKS] = fn(raw[start : start + _CHUNK_BLOCKS])
    return out.reshape(shape)
