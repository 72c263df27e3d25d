"""Programmatic dependent launch on a GPU: a graph-captured decode forward gives bit-identical
logits with PDL on and off, and the skinny linear's split-K launches (reduced by their last
split or by the second kernel) stay right when launched back to back under PDL."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.model import AttnMetadata, Model
from executor.ops import reference_ops
from executor.random_model import PRESETS
from kernels.arch import pdl_capable, pdl_enabled, pdl_forced
from kernels.skinny_linear import TUNED, skinny_linear, skinny_linear_ref
from loadtests.lab.kernels.pdl import GraphPair, blocks_per_seq, decode_batch, random_caches
from tests.kernels.models import random_norms_model
from tests.kernels.paged import rel_err

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
CONTEXT = 1024


@pytest.fixture(scope="module")
def pdl_device():
    if not pdl_capable(DEV):
        pytest.skip("PDL needs an NVIDIA GPU of compute capability 9+ and Triton 3.4+")
    return DEV


@pytest.fixture(scope="module")
def small_draft_shaped_model(pdl_device):
    """Two layers of the Qwen3-0.6B shape (every projection and the LM head take the skinny
    linear, split-K reduced both ways), random norm weights too, on the Triton path."""
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2)
    ref = random_norms_model(cfg, pdl_device, torch.bfloat16, max_position=CONTEXT + 64)
    return Model(
        cfg, ref.weights, device=pdl_device, dtype=torch.bfloat16, max_position=CONTEXT + 64
    )


@pytest.mark.parametrize(("num_seqs", "q_len"), [(1, 1), (4, 1), (1, 4), (16, 1), (4, 4)])
def test_graphed_forward_is_bit_identical_with_pdl_on_and_off(
    small_draft_shaped_model, num_seqs, q_len
):
    model = small_draft_shaped_model
    kv = random_caches(model, num_seqs * blocks_per_seq(CONTEXT, q_len), seed=num_seqs)
    batch = decode_batch(num_seqs, q_len, CONTEXT, model.config.vocab_size, DEV, seed=q_len)
    pair = GraphPair(model, kv, batch)
    off, on = pair.logits(False), pair.logits(True)  # [rows, vocab] each
    assert torch.equal(off, on)
    for _ in range(3):  # replays back to back: the PDL graph's launches overlap each other
        pair.graph(True).replay()
    assert torch.equal(pair.logits(True), off)
    # against the torch reference path (bf16 through 2 layers: loose)
    model.ops, triton_path = reference_ops(), model.ops
    try:
        meta = AttnMetadata(
            batch.positions, batch.slot_mapping, batch.cu_q_lens, batch.seq_lens,
            batch.block_tables, q_len,
        )  # fmt: skip
        ref = model.logits(model.forward(batch.input_ids, meta, kv.k, kv.v))
    finally:
        model.ops = triton_path
    assert off.isfinite().all()
    assert rel_err(off, ref) < 3e-2


@pytest.mark.parametrize(
    ("n", "k", "rows"),
    [
        (1024, 3072, 1),  # 8 splits reduced by the last split
        (1024, 2048, 1),  # 4 splits reduced by the second kernel
        (4096, 12288, 4),  # the target's down projection: 4 splits, last split reduces
        (6144, 1024, 16),  # unsplit
    ],
)
def test_skinny_linear_back_to_back_under_pdl_matches_the_reference(pdl_device, n, k, rows):
    cfg = TUNED[(n, k, rows)]
    gen = torch.Generator(device=DEV).manual_seed(n + k + rows)
    weight = (torch.randn(n, k, device=DEV, generator=gen) * k**-0.5).to(torch.bfloat16)
    xs = [
        torch.randn(rows, k, device=DEV, generator=gen).to(torch.bfloat16) for _ in range(48)
    ]  # [rows, k] each
    with pdl_forced(False):
        expected = [skinny_linear(x, weight, config=cfg) for x in xs]
    with pdl_forced(True):
        assert pdl_enabled(DEV)
        got = [skinny_linear(x, weight, config=cfg) for x in xs]  # one weight, its counters
        graph = torch.cuda.CUDAGraph()
        outs = []
        with torch.cuda.graph(graph):
            outs = [skinny_linear(x, weight, config=cfg) for x in xs[:16]]
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for x, want, out in zip(xs, expected, got):
        assert torch.equal(out, want)
        assert rel_err(out, skinny_linear_ref(x, weight)) < 1e-2
    for want, out in zip(expected, outs):
        assert torch.equal(out, want)
