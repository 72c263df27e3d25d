"""SiLU-and-mul fused into the down projection on a GPU: bf16 at the Qwen3-8B and Qwen3-0.6B
down projections, the fused launch gives the bits of silu_and_mul followed by the skinny linear,
eagerly and replayed from CUDA graphs captured with PDL on; a graph-captured decode forward
gives the same logits with the fusion on and off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.model import Model
from executor.random_model import PRESETS
from kernels.arch import pdl_capable, pdl_forced
from kernels.bench_fusion import FORWARDS_PER_CAPTURE, fusion_as_served
from kernels.bench_pdl import GraphPair, blocks_per_seq, decode_batch, random_caches
from kernels.norms import silu_and_mul
from kernels.skinny_linear import (
    TUNED,
    fused_prologue_forced,
    row_bucket,
    silu_mul_linear,
    silu_mul_skinny_linear,
    skinny_linear,
)
from tests.kernels.models import random_norms_model
from tests.kernels.paged import rel_err

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
CONTEXT = 1024
DOWN_SHAPES = {"qwen3-8b": (4096, 12288), "qwen3-0.6b": (1024, 3072)}  # (N, I)


@pytest.fixture(scope="module")
def pdl_device():
    if not pdl_capable(DEV):
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9+ and Triton 3.4+")
    return DEV


def _gate_up_and_weight(n: int, inter: int, rows: int, count: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    weight = (torch.randn(n, inter, device=DEV, generator=gen) * inter**-0.5).to(torch.bfloat16)
    gate_ups = [
        (torch.randn(rows, 2 * inter, device=DEV, generator=gen) * 2).to(torch.bfloat16)
        for _ in range(count)
    ]  # [rows, 2I] each
    return gate_ups, weight


@pytest.mark.parametrize("model", DOWN_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16])
def test_fused_equals_unfused_bit_for_bit(pdl_device, model, rows):
    n, inter = DOWN_SHAPES[model]
    cfg = TUNED[(n, inter, row_bucket(rows))]
    gate_ups, weight = _gate_up_and_weight(n, inter, rows, 1, seed=rows)
    (gate_up,) = gate_ups
    for pdl in (False, True):
        with pdl_forced(pdl):
            unfused = skinny_linear(silu_and_mul(gate_up), weight, None, cfg)
            fused = silu_mul_skinny_linear(gate_up, weight, None, cfg)
            assert torch.equal(fused, unfused)
            assert torch.equal(silu_mul_linear(gate_up, weight), unfused)  # the dispatch
    ref = torch.nn.functional.linear(silu_and_mul(gate_up).float(), weight.float())
    assert rel_err(fused, ref) < 1e-2


@pytest.mark.parametrize("model", DOWN_SHAPES)
@pytest.mark.parametrize("rows", [1, 16])
def test_fused_launches_back_to_back_in_a_pdl_graph(pdl_device, model, rows):
    """Fused and unfused launches alternating on one weight inside a graph captured with PDL
    on (one launch's tile counters reset while the next may already run) replay the eager
    PDL-off results, replay after replay."""
    n, inter = DOWN_SHAPES[model]
    cfg = TUNED[(n, inter, row_bucket(rows))]
    gate_ups, weight = _gate_up_and_weight(n, inter, rows, 12, seed=n + rows)
    with pdl_forced(False):
        expected = [skinny_linear(silu_and_mul(g), weight, None, cfg) for g in gate_ups]
    torch.cuda.synchronize()
    with pdl_forced(True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = []
            for g in gate_ups:
                outs.append(silu_mul_skinny_linear(g, weight, None, cfg))
                outs.append(skinny_linear(silu_and_mul(g), weight, None, cfg))
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, want in enumerate(expected):
            assert torch.equal(outs[2 * i], want) and torch.equal(outs[2 * i + 1], want)


@pytest.fixture(scope="module")
def small_draft_shaped_model(pdl_device):
    """Two layers of the Qwen3-0.6B shape with random norm weights, on the Triton path: every
    down projection takes the fused prologue."""
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2)
    ref = random_norms_model(cfg, pdl_device, torch.bfloat16, max_position=CONTEXT + 64)
    return Model(
        cfg, ref.weights, device=pdl_device, dtype=torch.bfloat16, max_position=CONTEXT + 64
    )


@pytest.mark.parametrize(("num_seqs", "q_len"), [(1, 1), (4, 1), (16, 1), (4, 4)])
def test_graphed_forward_is_bit_identical_with_fusion_on_and_off(
    small_draft_shaped_model, num_seqs, q_len
):
    model = small_draft_shaped_model
    kv = random_caches(model, num_seqs * blocks_per_seq(CONTEXT, q_len), seed=num_seqs)
    batch = decode_batch(num_seqs, q_len, CONTEXT, model.config.vocab_size, DEV, seed=q_len)
    counts = {False: [0], True: [0]}
    pair = GraphPair(model, kv, batch, switch=lambda on: fusion_as_served(on, counts[on]))
    assert counts[False][0] == 0
    assert counts[True][0] == model.config.num_layers * FORWARDS_PER_CAPTURE
    off, on = pair.logits(False), pair.logits(True)  # [rows, vocab] each
    assert off.isfinite().all()
    assert torch.equal(off, on)
    for _ in range(3):  # replays back to back: the PDL graph's launches overlap each other
        pair.graph(True).replay()
    assert torch.equal(pair.logits(True), off)
    with fused_prologue_forced(False):  # a graph keeps the launches it was captured with
        assert torch.equal(pair.logits(True), off)
