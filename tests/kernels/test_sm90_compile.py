"""The fused q/k kernel builds for sm_90 without a GPU (see `tests/kernels/sm90_compile.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend_available() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend_available(), reason="Triton without its NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_fused_qk_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default; silences the 3.9 notice
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 11, proc.stdout
