"""Rotary position embedding tables for the scaling types default, linear, llama3 and yarn.

The table is `cos_sin [max_pos, rot_dim]`: the first half of the last dim holds cos, the second
half sin, one entry per frequency (neox layout: frequency i rotates dims i and i + rot_dim/2).
Yarn's attention factor is folded into both halves, as transformers does.
"""

from __future__ import annotations

import math

import torch

from executor.model_config import RopeConfig


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_get_mscale(factor, rope.mscale) / _yarn_get_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_get_mscale(factor)

    # Dimension index at which a frequency makes `num_rotations` turns over the original context.
    def correction_dim(num_rotations: float) -> float:
        ratio = rope.original_max_position / (num_rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    # High-frequency dims (ramp 0) keep their frequency; low-frequency ones are interpolated.
    keep = 1.0 - ramp
    inv_freq = interpolation * (1.0 - keep) + extrapolation * keep
    return inv_freq, attention_factor


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_ctx = rope.original_max_position
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    dim = rope.rotary_dim or head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def build_cos_sin_cache(
    rope: RopeConfig, head_dim: int, max_pos: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Returns cos_sin [max_pos, rot_dim] float32 (cos half | sin half)."""
    inv_freq, scale = inv_freq_and_scale(rope, head_dim)
    positions = torch.arange(max_pos, dtype=torch.float64)
    freqs = torch.outer(positions, inv_freq)  # [max_pos, rot_dim/2]
    cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
    return cos_sin.to(device=device, dtype=torch.float32)
