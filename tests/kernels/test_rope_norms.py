"""RoPE + KV write and the norm kernels against their torch references (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.norms import (
    head_rms_norm,
    head_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from kernels.rope_kv import rope_and_write_kv, rope_and_write_kv_ref
from tests.kernels.paged import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@settings(max_examples=10)
@given(
    num_tokens=st.integers(1, 9),
    heads=st.sampled_from([(4, 1), (4, 4), (6, 2)]),
    head_dim=st.sampled_from([32, 64]),
    rot_frac=st.sampled_from([1.0, 0.5]),
    is_neox=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_rope_and_write_kv_matches_reference(
    num_tokens, heads, head_dim, rot_frac, is_neox, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    page_size, num_blocks = 4, 6
    rot_dim = int(head_dim * rot_frac)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEV)

    # q, k, v as strided views into one fused projection output, as the model produces them.
    qkv = rand(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen).to(DEV)
    cos_sin = torch.randn(100, rot_dim, generator=gen).to(DEV)
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1  # padding rows
    slots = slots.to(DEV)
    k_cache = rand(num_blocks, page_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks, page_size, num_kv_heads, head_dim)
    want_qkv, want_k, want_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    n = num_tokens
    wq = want_qkv[:, : num_q_heads * head_dim].view(n, num_q_heads, head_dim)
    wk = want_qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim]
    wk = wk.view(n, num_kv_heads, head_dim)
    rope_and_write_kv_ref(
        wq, wk, v.clone(), positions, cos_sin, slots, want_k, want_v, is_neox=is_neox
    )
    rope_and_write_kv(q, k, v, positions, cos_sin, slots, k_cache, v_cache, is_neox=is_neox)
    for got, want in ((qkv, want_qkv), (k_cache, want_k), (v_cache, want_v)):
        assert (got.float() - want.float()).abs().max() <= TOL[dtype] * 10


def test_rope_styles_differ_and_padding_is_untouched():
    q = torch.randn(2, 1, 8, device=DEV)
    k = torch.randn(2, 1, 8, device=DEV)
    v = torch.randn(2, 1, 8, device=DEV)
    cs = torch.randn(4, 8, device=DEV)
    pos = torch.tensor([1, 2], device=DEV)
    slots = torch.tensor([3, -1], device=DEV)
    cache = torch.zeros(2, 4, 1, 8, device=DEV)
    outs = []
    for neox in (True, False):
        qq, kk, kc, vc = q.clone(), k.clone(), cache.clone(), cache.clone()
        rope_and_write_kv(qq, kk, v, pos, cs, slots, kc, vc, is_neox=neox)
        assert torch.equal(qq[1], q[1]) and torch.equal(kk[1], k[1])  # slot -1: skipped
        assert torch.equal(kc[0, 3], kk[0]) and torch.equal(vc[0, 3], v[0])
        assert int((kc != 0).any(-1).sum()) == 1  # only slot 3 written
        outs.append(qq[0])
    assert not torch.allclose(outs[0], outs[1])


@settings(max_examples=8)
@given(
    num_rows=st.integers(1, 6),
    hidden=st.sampled_from([16, 48, 96]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_reference(num_rows, hidden, dtype, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=gen).to(dtype).to(DEV)
    w = torch.randn(hidden, generator=gen).to(dtype).to(DEV)
    res = torch.randn(num_rows, hidden, generator=gen).to(dtype).to(DEV) if with_residual else None
    got, want = rms_norm(x, w, 1e-6, res), rms_norm_ref(x, w, 1e-6, res)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the new residual is the rounded sum exactly
        got, want = got[0], want[0]
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_norm_and_silu_match_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(5, 7, 24, generator=gen).to(dtype).to(DEV)
    x = fused[:, 1:4]  # strided view: 3 heads of 24
    w = torch.randn(24, generator=gen).to(dtype).to(DEV)
    assert rel_err(head_rms_norm(x, w, 1e-6), head_rms_norm_ref(x, w, 1e-6)) < TOL[dtype]
    g = torch.randn(4, 2 * 37, generator=gen).to(dtype).to(DEV)
    assert rel_err(silu_and_mul(g), silu_and_mul_ref(g)) < TOL[dtype]
