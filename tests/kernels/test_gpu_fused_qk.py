"""The fused q/k norm + RoPE + KV store kernel at Qwen3-8B shapes in bf16 on a GPU: against the
bf16 reference (same rounding steps) and against the reference in fp32."""

from __future__ import annotations

import pytest
import torch

from executor.model_config import RopeConfig
from kernels.fused_qk import qk_norm_rope_and_write_kv
from tests.kernels.qkv_cases import QkvCase, build_inputs, check_against_fp32, check_case

pytestmark = pytest.mark.gpu

ROPES = {
    "default": RopeConfig(theta=1000000.0),
    "llama3": RopeConfig(
        theta=500000.0, rope_type="llama3", factor=8.0, original_max_position=1024
    ),
    "yarn": RopeConfig(theta=1000000.0, rope_type="yarn", factor=4.0, original_max_position=1024),
    "partial": RopeConfig(theta=10000.0, rotary_dim=64),
}


def _case(num_rows, rope="default", is_neox=True, qk_norm=True, **kw) -> QkvCase:
    return QkvCase(
        num_rows=num_rows,
        num_q_heads=kw.pop("num_q_heads", 32),
        num_kv_heads=kw.pop("num_kv_heads", 8),
        head_dim=kw.pop("head_dim", 128),
        rope=ROPES[rope],
        is_neox=is_neox,
        qk_norm=qk_norm,
        dtype=torch.bfloat16,
        device="cuda",
        seed=num_rows,
        **kw,
    )


@pytest.mark.parametrize("num_rows", [1, 7, 64, 512])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("is_neox", [True, False])
def test_fused_qk_bf16_qwen3_8b_shapes(num_rows, qk_norm, is_neox):
    case = _case(num_rows, is_neox=is_neox, qk_norm=qk_norm)
    check_case(case, 1e-2)
    check_against_fp32(case, 1e-2)


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 32, 128), (32, 1, 128), (28, 4, 64)], ids=str)
def test_fused_qk_bf16_rope_types_and_head_layouts(rope, heads):
    num_q_heads, num_kv_heads, head_dim = heads
    case = _case(
        300, rope=rope, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    check_case(case, 1e-2)
    check_against_fp32(case, 1e-2)


def test_fused_qk_bf16_graph_replay():
    inputs = build_inputs(_case(64, padded_every=5))
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    eager = qk_norm_rope_and_write_kv(**args, num_q_heads=32, is_neox=True)  # compiles
    k_eager = args["k_cache"].clone()
    args["k_cache"].copy_(inputs["k_cache"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qk_norm_rope_and_write_kv(**args, num_q_heads=32, is_neox=True)
    q.fill_(float("nan"))
    args["k_cache"].copy_(inputs["k_cache"])
    graph.replay()
    assert torch.equal(q, eager) and torch.equal(args["k_cache"], k_eager)
