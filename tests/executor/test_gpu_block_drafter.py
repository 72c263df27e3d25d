"""GPU checks of block drafting with the Triton kernels: every proposed block equals one drafted
from scratch (non-causal verify attention, the context write through the fused k-norm/RoPE
store with no query heads), eagerly and with the target's and the drafter's graphs replayed
(the hidden-state capture a static output of the target's); greedy outputs equal AR's."""

from __future__ import annotations

import pytest
import torch

from executor.drafters.block_model import load_block_drafter
from executor.loader import load_model
from tests.executor.test_spec_exactness import BLOCK_LEN, check_block_context
from tests.fixtures.tiny_block_drafter import make_tiny_block_drafter
from tests.fixtures.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/HIP GPU")
    target_dir = make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0)
    target = load_model(target_dir, dtype="float32", device=torch.device("cuda"))
    block_dir = make_tiny_block_drafter(
        tmp_path_factory.mktemp("block"), target.config, seed=7, block_size=BLOCK_LEN
    )
    return {"target": target, "block": load_block_drafter(block_dir, target)}


@pytest.mark.parametrize("graphs", ["off", "lazy"])
def test_block_context_follows_every_round_on_the_gpu(cuda_models, graphs):
    check_block_context(cuda_models, graphs=graphs, tol=2e-3)
