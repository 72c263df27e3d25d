"""Counter-based random numbers on the device, keyed per request.

Every random number the sampler uses is a pure function of `(seed, step, stream, counter)`:
- `seed`: the request's seed (its own, or one derived from the engine's base seed and req_id);
- `step`: a per-request counter that differs for every token the request samples (the
  executor passes the token's position in the sequence);
- `stream`: what the number is for (`Stream`), so that e.g. the acceptance test and the draw of
  the same token never share numbers;
- `counter`: the vocabulary index (exponential race) or the index of a uniform.

The batch row is not part of the key: a seeded request draws the same numbers whatever else is
in the batch, at whatever row, through AR or speculative rounds alike.

The hash is a 32-bit integer mixer (`mix32`); apart from one check per device (`prepare`), no
host-device synchronisation happens.
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
    """A bijective avalanche mixer on [0, 2**32) (the 'lowbias32' constants).

    It runs in int64 tensors: values stay in [0, 2**32) and every product is split into 16-bit
    halves, so no operation relies on signed overflow. The per-vocabulary-entry work (the bulk:
    [N, V] elements) runs the same mixer on int32 tensors with wrapping multiplication
    (`_mix32_wrapping_`), about a quarter of the memory traffic, where `prepare(device)` found
    that int32 arithmetic wraps and gives bit-identical results; elsewhere it falls back to this
    form."""
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


def _to_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2**32) -> int32 with the same 32 bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _mix32_wrapping_(x: torch.Tensor) -> torch.Tensor:
    """In place on int32: `mix32` with wrapping multiplication; arithmetic right shifts are
    masked into logical ones."""
    x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))
    x.mul_(_C1_INT32)
    x.bitwise_xor_((x >> 15).bitwise_and_(0x1FFFF))
    x.mul_(_C2_INT32)
    return x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))


_C1_INT32 = 0x7FEB352D
_C2_INT32 = 0x846CA68B - (1 << 32)


@functools.lru_cache(maxsize=16)
def _int32_wraps(device: torch.device) -> bool:
    x = torch.arange(0, 1 << 32, 4_194_301, dtype=torch.int64, device=device)  # [1024]
    fast = _mix32_wrapping_(_to_int32_bits(x)).to(torch.int64) & MASK32
    return bool(torch.equal(fast, mix32(x)))


@functools.lru_cache(maxsize=16)
def _counter_hashes(num: int, device: torch.device) -> torch.Tensor:
    """[num] int64: mix32 of 0..num-1 (offset so that counter 0 is not the fixed point 0)."""
    counters = torch.arange(num, dtype=torch.int64, device=device)
    return mix32((counters * _GOLDEN32 + 0x6A09E667) & MASK32)


@functools.lru_cache(maxsize=16)
def _counter_hashes_int32(num: int, device: torch.device) -> torch.Tensor:
    return _to_int32_bits(_counter_hashes(num, device))


def prepare(device: torch.device | str, num: int) -> None:
    """Runs the one-time work for `device` and counters up to `num` (the vocabulary size): the
    int32 check (a host sync) and the counter tables. Call it before capturing CUDA graphs."""
    device = torch.empty(0, device=device).device  # with its index, as tensors report it
    if _int32_wraps(device):
        _counter_hashes_int32(num, device)
    else:
        _counter_hashes(num, device)


def random_bits(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """seed, step [N] int64 -> [N, num] int64 uniform in [0, 2**32) (the int64 reference form)."""
    keys = row_keys(seed, step, stream)  # [N]
    return mix32(keys[:, None] ^ _counter_hashes(num, seed.device)[None, :])  # [N, num]


def _top24_bits(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """The high 24 bits of `random_bits`, [N, num] int32 or int64 by the device's fast path."""
    if not _int32_wraps(seed.device):
        return random_bits(seed, step, stream, num) >> 8
    keys = _to_int32_bits(row_keys(seed, step, stream))  # [N]
    bits = keys[:, None] ^ _counter_hashes_int32(num, seed.device)[None, :]  # [N, num]
    return (_mix32_wrapping_(bits) >> 8).bitwise_and_(0xFFFFFF)


def uniforms(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """[N, num] float32 uniform in the open interval (0, 1): 24 random bits, centred in their
    cell, so that log(u) and 1/u stay finite."""
    bits = _top24_bits(seed, step, stream, num)  # [N, num], < 2**24: exact in fp32
    return bits.to(torch.float32).add_(0.5).mul_(_UNIFORM_SCALE)


def exponentials(seed: torch.Tensor, step: torch.Tensor, stream: int, num: int) -> torch.Tensor:
    """[N, num] float32 Exp(1) draws, each in (0, 17.4)."""
    return uniforms(seed, step, stream, num).log_().neg_()
