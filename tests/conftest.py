"""Suite-wide settings: GPU tests are skipped without a CUDA/HIP device, whose absence also puts
Triton in its interpreter."""

from __future__ import annotations

import os

import pytest

# Hypothesis: bounded, deterministic runs so CI time is predictable on 2 cores.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# One intra-op thread: the suite runs tiny models on a 2-core machine, where torch's thread pool
# costs far more in synchronisation than it gains (measured ~10x on tiny-model generation).
try:
    import torch

    torch.set_num_threads(1)
    # Without a GPU, Triton kernels run in its interpreter. The flag must be set before triton is
    # first imported (its own jit helpers, e.g. tl.topk, are made at that import), and any test
    # module may import a kernel module at collection, before tests/kernels/ is reached.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/HIP GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
