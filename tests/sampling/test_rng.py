"""The counter-based generator: exact integer hashing, uniform output, keys independent of the
batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor import rng
from executor.rng import Stream


def test_mix32_matches_host_twin_and_is_injective():
    x = torch.randint(
        0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(0)
    )
    mixed = rng.mix32(x)
    assert [rng._mix32_int(int(a)) for a in x] == mixed.tolist()
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    small = rng.mix32(torch.arange(1 << 16, dtype=torch.int64))
    assert small.unique().numel() == 1 << 16  # a bijection has no collisions


@given(seed=st.integers(-(2**70), 2**70), step=st.integers(0, 2**40))
def test_row_is_independent_of_batch(seed, step):
    """A row's numbers depend only on (seed, step, stream), not on its neighbours or position."""
    s = rng.seed_to_int64(seed)
    alone = rng.uniforms(torch.tensor([s]), torch.tensor([step]), Stream.SAMPLE, 7)
    seeds = torch.tensor([11, s, -5])
    steps = torch.tensor([3, step, 9])
    batched = rng.uniforms(seeds, steps, Stream.SAMPLE, 7)
    assert torch.equal(alone[0], batched[1])
    assert bool(((alone > 0) & (alone < 1)).all())


def test_streams_steps_and_seeds_differ():
    seed = torch.tensor([7, 7, 8])
    step = torch.tensor([0, 1, 0])
    a = rng.random_bits(seed, step, Stream.SAMPLE, 64)
    b = rng.random_bits(seed, step, Stream.ACCEPT, 64)
    assert not torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


def test_uniform_moments_and_pair_correlation():
    num_rows, num = 256, 4096
    u = rng.uniforms(torch.arange(num_rows), torch.zeros(num_rows, dtype=torch.int64), 1, num)
    u = u.double()
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    # Neighbouring seeds and neighbouring counters are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 5e-3
    # Equal-width bins are filled evenly (chi-square, 16 bins, far beyond p = 1e-6 would fail).
    counts = torch.histc(u.float(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 60


def test_exponentials_have_unit_mean():
    e = rng.exponentials(torch.tensor([1, 2]), torch.tensor([0, 0]), Stream.SAMPLE, 50_000)
    assert abs(e.double().mean().item() - 1.0) < 0.02
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())


def test_derived_seeds():
    assert rng.derive_seed(0, 5) == rng.derive_seed(0, 5)
    assert rng.derive_seed(0, 5) != rng.derive_seed(1, 5)
    assert rng.derive_seed(0, 5) != rng.derive_seed(0, 6)
    assert rng.derive_seed(0, 5) not in range(-1000, 1000)
    assert -(2**63) <= rng.derive_seed(2**40, 2**40) < 2**63
    assert rng.seed_to_int64(-1) == -1 and rng.seed_to_int64(2**64 + 3) == 3


def test_int32_fast_path_equals_int64_reference(monkeypatch):
    seed = torch.tensor([0, -3, 2**62, 12345])
    step = torch.tensor([0, 17, 2**35, 4])
    rng.prepare("cpu", 500)
    reference = ((rng.random_bits(seed, step, Stream.ACCEPT, 500) >> 8).float() + 0.5) / 2**24
    fast = rng.uniforms(seed, step, Stream.ACCEPT, 500)
    monkeypatch.setattr(rng, "_int32_wraps", lambda device: False)
    fallback = rng.uniforms(seed, step, Stream.ACCEPT, 500)
    assert torch.equal(fast, reference) and torch.equal(fallback, reference)


@pytest.mark.gpu
def test_device_matches_cpu_bit_for_bit():
    seed = torch.tensor([0, -3, 2**62, 12345])
    step = torch.tensor([0, 17, 2**35, 4])
    cpu = rng.uniforms(seed, step, Stream.SAMPLE, 1000)
    gpu = rng.uniforms(seed.cuda(), step.cuda(), Stream.SAMPLE, 1000).cpu()
    assert torch.equal(cpu, gpu)
