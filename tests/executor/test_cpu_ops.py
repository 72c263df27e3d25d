"""The CPU op set (executor/cpu_ops.py) gives bitwise the references' results: rows of several
sequences, prefill and speculative groups, padded rows, GQA, q/k norms, causal or not."""

from __future__ import annotations

import pytest
import torch

from executor import cpu_ops
from executor.model import AttnMetadata
from executor.ops import select_ops
from kernels.attention import verify_attention_ref
from kernels.fused_qk import qk_norm_rope_and_write_kv_ref
from kernels.norms import rms_norm_ref, silu_and_mul_ref

PAGE = 16


def _batch(q_lens, kv_lens, num_blocks, seed, pad_rows=0):
    """Metadata of sequences with `q_lens` new rows ending at `kv_lens`, pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-n // PAGE) for n in kv_lens)
    tables = torch.zeros((len(q_lens), width), dtype=torch.int32)
    positions, slots, used = [], [], 0
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        pages = perm[used : used + -(-kv_len // PAGE)]
        used += len(pages)
        tables[s, : len(pages)] = pages.int()
        for pos in range(kv_len - q_len, kv_len):
            positions.append(pos)
            slots.append(int(pages[pos // PAGE]) * PAGE + pos % PAGE)
    positions += [0] * pad_rows
    slots += [-1] * pad_rows
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttnMetadata(
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        cu_q_lens=cu,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=tables,
    )


CASES = [
    # q_lens, kv_lens, Hq, Hkv, padded rows, causal
    ((1,), (150,), 6, 2, 0, True),
    ((1, 1, 1, 1), (3, 40, 17, 99), 6, 2, 0, True),
    ((8, 1, 5), (8, 33, 70), 4, 4, 0, True),
    ((3, 16), (20, 50), 8, 1, 3, True),
    ((16, 16), (40, 16), 6, 2, 0, False),
]


@pytest.mark.parametrize("rot_dim", [64, 32])  # 32: partial rotary (Qwen3.5)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_layer_ops_match_references_bitwise(case, qk_norm, dtype, rot_dim):
    q_lens, kv_lens, hq, hkv, pad, causal = case
    head_dim, num_blocks = 64, 64
    meta = _batch(q_lens, kv_lens, num_blocks, seed=len(q_lens) + hq, pad_rows=pad)
    n = meta.positions.shape[0]
    g = torch.Generator().manual_seed(7)
    cos_sin = torch.randn((512, rot_dim), generator=g)
    caches = [torch.randn((num_blocks, PAGE, hkv, head_dim), generator=g).to(dtype) for _ in "kv"]
    qkv = torch.randn((n, (hq + 2 * hkv) * head_dim), generator=g).to(dtype)
    norms = (
        [torch.rand(head_dim, generator=g).to(dtype) + 0.5 for _ in "qk"] if qk_norm else [None] * 2
    )
    ref_caches = [c.clone() for c in caches]
    args = (meta.positions, cos_sin, meta.slot_mapping)
    q_ref = qk_norm_rope_and_write_kv_ref(
        qkv, *norms, 1e-6, *args, *ref_caches, num_q_heads=hq, is_neox=True
    )
    plan = cpu_ops.forward_plan(meta.positions, meta.slot_mapping, cos_sin, meta, causal)
    for _ in range(2):  # a second layer reads the plan built by the first
        q = cpu_ops.qk_norm_rope_and_write_kv(
            qkv, *norms, 1e-6, *args, *caches, num_q_heads=hq, is_neox=True, plan=plan
        )
        assert q.is_contiguous() and torch.equal(q, q_ref)
        assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
        lens = (meta.cu_q_lens, meta.seq_lens, meta.block_tables, 0.125)
        out_ref = verify_attention_ref(q_ref, *ref_caches, *lens, causal=causal)
        out = cpu_ops.verify_attention(q, *caches, *lens, causal=causal, plan=plan)
        assert torch.equal(out, out_ref)
    # a context write: no query heads, no attention
    kv = qkv[:, hq * head_dim :]
    cpu_ops.qk_norm_rope_and_write_kv(
        kv, *norms, 1e-6, *args, *caches, num_q_heads=0, is_neox=True,
        plan=cpu_ops.forward_plan(meta.positions, meta.slot_mapping, cos_sin),
    )  # fmt: skip
    qk_norm_rope_and_write_kv_ref(kv, *norms, 1e-6, *args, *ref_caches, num_q_heads=0, is_neox=True)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_references_bitwise(dtype):
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn((5, 384), generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(384, generator=g) + 0.5).to(dtype)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    for got, want in zip(cpu_ops.rms_norm(x, w, 1e-6, res), rms_norm_ref(x, w, 1e-6, res)):
        assert torch.equal(got, want)
    gate_up = torch.randn((5, 2 * 96), generator=g).to(dtype)
    assert torch.equal(cpu_ops.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


def test_cpu_models_take_the_cpu_op_set():
    assert select_ops(torch.device("cpu")).forward_plan is cpu_ops.forward_plan
    assert select_ops(torch.device("cpu"), "torch").forward_plan is cpu_ops.forward_plan


@pytest.mark.parametrize(("n", "k"), [(160, 32), (96, 32), (32, 96), (40, 40)])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), (12,)])
def test_linear_matches_f_linear(n, k, lead):
    """cpu_ops.linear is F.linear up to rounding in each of its forms (a wide weight: one row
    and many rows from its transposed copy, a few rows as W @ x^T); the copy is made once and
    made again after the weight changes in place."""
    gen = torch.Generator().manual_seed(n * k + len(lead))
    w = torch.randn((n, k), generator=gen)
    b = torch.randn((n,), generator=gen)
    x = torch.randn((*lead, k), generator=gen)
    for bias in (None, b):
        got = cpu_ops.linear(x, w, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias))
        assert got.shape == (*lead, n) and got.is_contiguous()
    rows = x.numel() // k
    copied = n >= cpu_ops.WIDE * k and not 2 <= rows <= cpu_ops.FEW_ROWS
    held = getattr(w, cpu_ops._TRANSPOSED, None)
    assert (held is not None) == copied
    if copied:
        cpu_ops.linear(x, w)
        assert getattr(w, cpu_ops._TRANSPOSED) is held  # reused
        w.mul_(2.0)
        torch.testing.assert_close(cpu_ops.linear(x, w), torch.nn.functional.linear(x, w))
