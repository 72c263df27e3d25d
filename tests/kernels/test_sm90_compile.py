"""The kernels build for sm_90 without a GPU (`tests/kernels/sm90.py`): every variant of the
fused q/k kernel (`sm90_compile.py`), and the Hopper entry's verify-attention launches, which
must also fit as many programs per SM as the split rule counts (`attention_sm90_compile.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.attention_sm90_compile import SHAPES
from tests.kernels.sm90 import run_compile_check, triton_backends

REPO_ROOT = Path(__file__).resolve().parents[2]


pytestmark = [
    pytest.mark.skipif(
        "nvidia" not in triton_backends(), reason="Triton without its NVIDIA backend"
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real"),
]


def test_fused_qk_kernel_compiles_for_sm90():
    assert run_compile_check("tests.kernels.sm90_compile").count("ok ") == 11


def test_hopper_attention_launches_compile_and_fit_their_programs_per_sm():
    assert run_compile_check("tests.kernels.attention_sm90_compile").count("ok ") == len(SHAPES)
