"""The arch table: exact family detection and entries that fit their hardware."""

from __future__ import annotations

import pytest
import torch

from kernels.arch import (
    FAMILY_CONFIGS,
    arch_config,
    family_of_amd_arch,
    family_of_cuda_capability,
    kernels_available,
)


@pytest.mark.parametrize(
    ("gcn", "family"),
    [
        ("gfx1100", "rdna3"),
        ("gfx1101", "rdna3"),
        ("gfx1151", "rdna3"),  # Strix Halo
        ("gfx1201", "rdna4"),  # R9700
        ("gfx1200", "rdna4"),
        ("gfx942:sramecc+:xnack-", "cdna3"),
        ("gfx1030", "default"),  # RDNA2: no WMMA
        ("gfx1036", "default"),
        ("gfx90a", "default"),
        ("gfx11", "default"),
        ("", "default"),
    ],
)
def test_amd_family_detection_is_exact(gcn, family):
    assert family_of_amd_arch(gcn) == family


def test_cuda_family_detection():
    assert family_of_cuda_capability(9, 0) == "hopper"
    assert family_of_cuda_capability(8, 0) == "ampere_ada"
    assert family_of_cuda_capability(8, 9) == "ampere_ada"
    assert family_of_cuda_capability(7, 5) == "default"


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_entries_fit_their_hardware(family):
    cfg = FAMILY_CONFIGS[family]
    tiles = cfg.attention
    assert cfg.family == family
    assert _pow2(tiles.block_n) and _pow2(tiles.max_block_m) and tiles.max_block_m >= 16
    assert _pow2(cfg.vocab_chunk)
    # K and V tiles of head_dim 128 in bf16, once per pipeline stage, must fit the LDS.
    assert 2 * tiles.block_n * 128 * 2 * max(1, tiles.num_stages) <= cfg.lds_bytes
    assert cfg.warp_size == (64 if family == "cdna3" else 32)


def test_cpu_takes_the_reference_path():
    assert not kernels_available("cpu")
    assert arch_config(torch.device("cpu")).family == "default"
