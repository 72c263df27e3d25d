"""Counter-based random numbers on the device, keyed per request.

Every random number the sampler uses is a pure function of
`(seed, step, stream, counter)`:
- `seed`: the request's seed (its own, or one derived from the engine's base seed and req_id);
- `step`: a per-request counter that differs for every token the request samples (the
  executor passes the token's position in the sequence);
- `stream`: what the number is for (`Stream`), so that e.g. the acceptance test and the draw of
  the same token never share numbers;
- `counter`: the vocabulary index (exponential race) or the index of a uniform.

The batch row is deliberately not part of the key: a seeded request draws the same numbers
whatever else is in the batch, at whatever row, through AR or speculative rounds alike.

The hash is a 32-bit integer mixer (xor-shift / multiply rounds with well-tested constants)
computed in int64 tensors: values stay in [0, 2**32) and every product is split into 16-bit
halves, so no operation relies on signed overflow. No host-device synchronisation happens.
"""

from __future__ import annotations

import enum
import functools

import torch

MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_GOLDEN32 = 0x9E3779B9
_UNIFORM_SCALE = 2.0**-24


class Stream(enum.IntEnum):
    SAMPLE = 1  # exponential race of a token draw from a distribution
    ACCEPT = 2  # uniforms of the rejection-sampling acceptance test
    RESIDUAL = 3  # the draw after a rejection, from the residual distribution
    BONUS = 4  # free for callers that need one more independent family


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) and a 32-bit constant, without int64 overflow:
    the high half's product only matters modulo 2**16."""
    low = (x & 0xFFFF) * c  # < 2**48
    high = (((x >> 16) * c) & 0xFFFF) << 16  # < 2**32
    return (low + high) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mixer on [0, 2**32) (the 'lowbias32' constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """Host twin of `mix32` for Python ints (used to derive seeds)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def seed_to_int64(seed: int) -> int:
    """Any Python int seed as the signed int64 holding its low 64 bits (how a tensor stores it)."""
    seed &= _MASK64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def derive_seed(base_seed: int, req_id: int) -> int:
    """The seed of a request without one: a function of the engine's base seed and the request
    id. Mixed, so that it does not coincide with small user seeds such as base_seed + req_id."""
    lo = _mix32_int(_mix32_int(base_seed ^ 0x5EED0001) ^ (req_id & MASK32))
    hi = _mix32_int(_mix32_int((base_seed >> 32) ^ 0x5EED0002) ^ ((req_id >> 32) & MASK32) ^ lo)
    return seed_to_int64((hi << 32) | lo)


def row_keys(seed: torch.Tensor, step: torch.Tensor, stream: int) -> torch.Tensor:
    """seed, step [N] int64 -> [N] int64 keys in [0, 2**32)."""
    key = mix32((seed & MASK32) ^ ((int(stream) * _GOLDEN32) & MASK32))
    key = mix32(key ^ ((seed >> 32) & MASK32))
    key = mix32(key ^ (step & MASK32))
    return mix32(key ^ ((step >> 32) & MASK32))


@functools.lru_cache(maxsize=16)
def _counter_hashes(num: int, device: torch.device) -> torch.Tensor:
    """[num] int64: mix32 of 0..num-1 (offset so that counter 0 is not the fixed point 0)."""
    counters = torch.arange(num, dtype=torch.int64, device=device)
    return mix32((counters * _GOLDEN32 + 0x6A09E667) & MASK32)


def random_bits(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """seed, step [N] int64 -> [N, num] int64 uniform in [0, 2**32)."""
    keys = row_keys(seed, step, stream)  # [N]
    return mix32(keys[:, None] ^ _counter_hashes(num, seed.device)[None, :])  # [N, num]


def uniforms(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """[N, num] float32 uniform in the open interval (0, 1): 24 random bits, centred in their
    cell, so that log(u) and 1/u stay finite."""
    bits = random_bits(seed, step, stream, num) >> 8  # [N, num], < 2**24: exact in fp32
    return (bits.to(torch.float32) + 0.5) * _UNIFORM_SCALE


def exponentials(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """[N, num] float32 Exp(1) draws, each in (0, 17.4)."""
    return -torch.log(uniforms(seed, step, stream, num))
