"""The kernels at realistic shapes in bf16 on a GPU, against the torch references in fp32."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.accept import accept_greedy, accept_greedy_ref, accept_rejection
from kernels.argmax import argmax_rows, topk_rows
from kernels.attention import verify_attention, verify_attention_ref
from kernels.norms import (
    head_rms_norm,
    head_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from kernels.rope_kv import rope_and_write_kv, rope_and_write_kv_ref
from tests.kernels.paged import ragged_batch, rel_err

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 7, None])
def test_verify_attention_bf16_ragged(gqa, head_dim, num_splits):
    # AR rows, spec verifies of 8 and 16 rows, a 300-row prefill chunk, a padded sequence.
    q_lens = [1, 8, 16, 300, 1, 0, 16, 5]
    ctx_lens = [4000, 37, 1500, 700, 0, 0, 3000, 15]
    num_kv_heads = 8 if gqa < 8 else 4
    batch = ragged_batch(
        q_lens,
        ctx_lens,
        num_q_heads=num_kv_heads * gqa,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=16,
        dtype=BF16,
        device=DEV,
        pad_rows=3,
        seed=gqa,
    )
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(batch[0], float("nan"))
    verify_attention(*batch, scale, out, num_splits=num_splits, max_q_len=16)
    ref = verify_attention_ref(*[t.float() if t.is_floating_point() else t for t in batch], scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    assert (out[-3:] == 0).all()


def test_verify_attention_per_row_matches_tiled():
    batch = ragged_batch(
        [16] * 4,
        [8000] * 4,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=BF16,
        device=DEV,
    )
    tiled = verify_attention(*batch, 0.088, max_q_len=16)
    per_row = verify_attention(*batch, 0.088, rows_per_tile=1)
    assert rel_err(tiled, per_row) < 1e-2


def test_verify_attention_graph_capture():
    batch = ragged_batch(
        [8, 1, 0],
        [900, 3000, 0],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=BF16,
        device=DEV,
    )
    out = torch.empty_like(batch[0])
    verify_attention(*batch, 0.088, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(*batch, 0.088, out)
    out.fill_(float("nan"))
    graph.replay()
    ref = verify_attention_ref(*[t.float() if t.is_floating_point() else t for t in batch], 0.088)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("rot_dim", [128, 64])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_and_write_kv_bf16(rot_dim, is_neox):
    n, hq, hkv, d = 700, 32, 8, 128
    q = torch.randn(n, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(n, hkv, d, device=DEV, dtype=BF16)
    v = torch.randn(n, hkv, d, device=DEV, dtype=BF16)
    pos = torch.randint(0, 32768, (n,), device=DEV)
    cs = torch.randn(32768, rot_dim, device=DEV)
    slots = torch.randperm(256 * 16, device=DEV)[:n]
    slots[::50] = -1
    kc = torch.randn(256, 16, hkv, d, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    clones = [t.clone() for t in (q, k, kc, vc)]
    rope_and_write_kv(q, k, v, pos, cs, slots, kc, vc, is_neox=is_neox)
    rope_and_write_kv_ref(
        clones[0], clones[1], v, pos, cs, slots, clones[2], clones[3], is_neox=is_neox
    )
    for got, want in zip((q, k, kc, vc), clones):
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def test_norms_bf16():
    x = torch.randn(513, 4096, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    out, h = rms_norm(x, w, 1e-6, r)
    out_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    assert rel_err(out, out_ref) < 1e-2
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < 1e-2
    qkv = torch.randn(513, 48 * 128, device=DEV, dtype=BF16)
    qv = qkv[:, : 32 * 128].view(513, 32, 128)
    wq = torch.randn(128, device=DEV, dtype=BF16)
    assert rel_err(head_rms_norm(qv, wq, 1e-6), head_rms_norm_ref(qv, wq, 1e-6)) < 1e-2
    g = torch.randn(513, 2 * 12288, device=DEV, dtype=BF16)
    assert rel_err(silu_and_mul(g), silu_and_mul_ref(g)) < 1e-2


@pytest.mark.parametrize("vocab", [151936, 262144])
def test_argmax_topk_large_vocab(vocab):
    logits = torch.randn(37, vocab, device=DEV, dtype=BF16)
    logits[3, 7] = logits[3, vocab - 1] = 100.0  # a tie: the smaller id wins
    ids = argmax_rows(logits)
    assert torch.equal(ids, logits.argmax(-1))
    assert int(ids[3]) == 7
    values, top_ids = topk_rows(logits.float(), 32)
    ref_values, _ = torch.topk(logits.float(), 32, dim=-1)
    assert torch.equal(values, ref_values)
    assert torch.equal(logits.float().gather(1, top_ids), values)


def test_accept_on_gpu():
    seqs, depth, vocab = 64, 8, 151936
    rows = seqs * depth
    cu = torch.arange(0, seqs + 1, dtype=torch.int32, device=DEV) * depth
    tgt = torch.randint(0, 3, (rows,), device=DEV)
    drf = torch.randint(0, 3, (rows,), device=DEV)
    got = accept_greedy(tgt, drf, cu, max_rows=depth)
    want = accept_greedy_ref(tgt, drf, cu, max_rows=depth)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
    # Draft == target distribution: every draft is accepted (u * q < p holds for u < 1).
    p = torch.softmax(torch.randn(rows, vocab, device=DEV), -1)
    drf = torch.multinomial(p, 1).squeeze(1)
    u = torch.rand(rows, device=DEV) * 0.999
    num_acc, out = accept_rejection(p, p, drf, cu, u, torch.rand(rows, device=DEV), max_rows=depth)
    assert (num_acc == depth - 1).all()
    assert torch.equal(out[:, : depth - 1].long(), drf.view(seqs, depth)[:, :-1])
    assert ((out[:, -1] >= 0) & (out[:, -1] < vocab)).all()


@pytest.mark.gpu
def test_no_attention_compile_after_the_variants_are_compiled():
    """After `compile_variants`, rounds of any shape within its bounds load no new kernel."""
    import random

    from kernels import attention

    device = torch.device("cuda")
    num_blocks, page, num_kv_heads, head_dim, num_q_heads = 64, 16, 8, 128, 32
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    attention.compile_variants(k, v, num_q_heads, max_seqs=16, max_q_len=64, max_kv_len=512)

    from loadtests.lab.compile_log import CompileLog

    compiles = CompileLog().install()
    rng = random.Random(0)
    # block tables one block wide, a multiple of 16 wide and neither (an eager round's table is
    # as wide as its longest sequence; a graph's is a bucket)
    widths = [1, 16, 17, 32, 3] + [None] * 35
    for extra_width in widths:
        num_seqs = rng.randint(1, 16)
        q_lens = [rng.randint(1, 16 if extra_width == 1 else 64) for _ in range(num_seqs)]
        ctx = [rng.randint(0, (16 if extra_width == 1 else 512) - q) for q in q_lens]
        seq_lens = [c + q for c, q in zip(ctx, q_lens)]
        width = max(-(-max(seq_lens) // page), extra_width or 0)
        tables = torch.randint(0, num_blocks, (num_seqs, width), dtype=torch.int32, device=device)
        cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
        q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device, dtype=torch.bfloat16)
        attention.verify_attention(
            q,
            k,
            v,
            cu,
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            tables,
            head_dim**-0.5,
            max_q_len=max(q_lens),
        )
    torch.cuda.synchronize()
    compiles.uninstall()
    assert compiles.method != "no Triton JIT hook found"
    attention_kernels = {"_verify_attention_kernel", "_merge_splits_kernel"}
    assert [e["kernel"] for e in compiles.events if e["kernel"] in attention_kernels] == []
