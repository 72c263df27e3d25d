"""The Hopper entry's verify-attention launches build for sm_90 without a GPU, and fit as many
programs per SM as the split rule counts (see `tests/kernels/attention_sm90_compile.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.attention_sm90_compile import SHAPES

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend_available() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend_available(), reason="Triton without its NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real")
def test_hopper_attention_launches_compile_and_fit_their_programs_per_sm():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the GPU default; silences the 3.9 notice
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.attention_sm90_compile"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(SHAPES), proc.stdout
