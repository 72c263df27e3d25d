"""The PDL switch: on only for native NVIDIA sm90+ launches with a Triton that has it, off with
HIPFIRE_PDL=0, flippable inside a process by `pdl_forced`, and always passed to a kernel as its
`USE_PDL` constexpr together with the `launch_pdl` option."""

from __future__ import annotations

import pytest
import torch

from executor import ops
from kernels import arch

CUDA0 = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture
def capable(monkeypatch):
    """Pretends every CUDA device is PDL-capable (the decision's other inputs stay real)."""
    monkeypatch.setattr(arch, "pdl_capable", lambda device: True)
    arch._pdl_env_allows.cache_clear()
    yield
    arch._pdl_env_allows.cache_clear()


def test_never_on_the_cpu():
    cpu = torch.device("cpu")
    assert not arch.pdl_enabled(cpu)
    assert arch.pdl_options(cpu) == {"USE_PDL": False}
    with arch.pdl_forced(True):
        assert not arch.pdl_enabled(cpu)
        assert arch.pdl_options(cpu) == {"USE_PDL": False}
    assert not ops.pdl_enabled(cpu)


def test_on_by_default_off_with_the_environment_variable(capable, monkeypatch):
    monkeypatch.delenv(arch.PDL_ENV, raising=False)
    assert arch.pdl_enabled(CUDA0)
    assert arch.pdl_options(CUDA0) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv(arch.PDL_ENV, "0")
    assert arch.pdl_enabled(CUDA0), "the variable is read once per process"
    arch._pdl_env_allows.cache_clear()
    assert not arch.pdl_enabled(CUDA0)
    assert arch.pdl_options(CUDA0) == {"USE_PDL": False}
    monkeypatch.setenv(arch.PDL_ENV, "1")
    arch._pdl_env_allows.cache_clear()
    assert arch.pdl_enabled(CUDA0)


def test_forced_inside_a_block_and_restored(capable, monkeypatch):
    monkeypatch.setenv(arch.PDL_ENV, "0")
    assert not arch.pdl_enabled(CUDA0)
    with ops.pdl_forced(True):
        assert ops.pdl_enabled(CUDA0)
        with arch.pdl_forced(False):
            assert not arch.pdl_enabled(CUDA0)
            assert arch.pdl_options(CUDA0) == {"USE_PDL": False}
        assert arch.pdl_enabled(CUDA0)
    assert not arch.pdl_enabled(CUDA0)
    with pytest.raises(RuntimeError), arch.pdl_forced(True):
        raise RuntimeError
    assert not arch.pdl_enabled(CUDA0)


def test_forcing_never_turns_it_on_where_the_device_cannot(monkeypatch):
    monkeypatch.setattr(arch, "pdl_capable", lambda device: False)
    with arch.pdl_forced(True):
        assert not arch.pdl_enabled(CUDA0)


@pytest.mark.parametrize(
    ("capability", "interpreter", "hip", "expected"),
    [
        ((9, 0), False, False, True),
        ((10, 0), False, False, True),
        ((8, 9), False, False, False),
        ((9, 0), True, False, False),
        ((9, 0), False, True, False),
    ],
)
def test_capable_only_natively_on_nvidia_sm90_and_later(
    monkeypatch, capability, interpreter, hip, expected
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreter else "0")
    monkeypatch.setattr(torch.version, "hip", "6.2" if hip else None)
    arch._pdl_capable.cache_clear()
    try:
        assert arch.pdl_capable(CUDA0) is expected
        assert arch.pdl_capable(torch.device("cpu")) is False
    finally:
        arch._pdl_capable.cache_clear()


def test_this_triton_has_the_launch_option_and_the_instructions():
    # Triton 3.4 and later (the GPU machines have 3.6); without them the switch stays off.
    assert arch.triton_has_pdl()
