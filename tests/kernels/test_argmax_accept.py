"""Argmax / top-k and the accept kernels against their references (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.accept import (
    accept_greedy,
    accept_greedy_ref,
    accept_rejection,
    accept_rejection_ref,
)
from kernels.argmax import argmax_rows, topk_rows, topk_rows_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=10)
@given(
    num_rows=st.integers(1, 5),
    vocab=st.integers(1, 5000),
    k=st.integers(1, 32),
    few_values=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_topk_and_argmax_match_reference(num_rows, vocab, k, few_values, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if few_values:  # many ties: order must be by value, then by smaller id
        logits = torch.randint(0, 3, (num_rows, vocab), generator=gen).to(dtype)
    else:
        logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    logits = logits.to(DEV)
    k = min(k, vocab)
    values, ids = topk_rows(logits, k)
    want_values, want_ids = topk_rows_ref(logits, k)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


@pytest.mark.parametrize("sorted_path", [True, False])
def test_topk_paths_on_signed_zeros_infinities_and_chunk_ends(monkeypatch, sorted_path):
    """Both top-k paths (packed keys + tl.topk, and k rounds of max) on values whose packing is
    delicate: -0.0 equals 0.0 (smaller id first), -inf, ties across a chunk boundary, k not a
    power of two."""
    import kernels.argmax as argmax

    monkeypatch.setattr(argmax, "HAS_TL_TOPK", sorted_path and argmax.HAS_TL_TOPK)
    vocab = 5000  # two chunks of 4096 (the arch table's vocab_chunk) or more
    logits = torch.full((3, vocab), -float("inf"))
    logits[0, [10, 4095, 4096, 4999]] = torch.tensor([1.5, 2.0, 2.0, -0.0])
    logits[0, 7] = 0.0
    logits[1] = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    logits[1, 4200] = logits[1, 3] = -3.25
    logits[2, :] = -0.0
    logits[2, 4500] = 0.0
    logits = logits.to(DEV)
    for k in (2, 5, 13, 32):
        values, ids = topk_rows(logits, k)
        want_values, want_ids = topk_rows_ref(logits, k)
        assert torch.equal(ids, want_ids), (k, ids, want_ids)
        assert torch.equal(values, want_values)


def test_topk_rejects_large_k():
    with pytest.raises(AssertionError):
        topk_rows(torch.randn(2, 100, device=DEV), 33)


def _rows(draw_counts: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(draw_counts) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(draw_counts, dtype=torch.int32).cumsum(0)
    return cu.to(DEV)


@settings(max_examples=15)
@given(
    row_counts=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    max_rows=st.integers(4, 6),
    match_prob=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_greedy_accept_matches_reference(row_counts, max_rows, match_prob, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = _rows(row_counts)
    num_rows = sum(row_counts)
    target = torch.randint(0, 50, (num_rows,), generator=gen)
    draft = torch.where(
        torch.rand(num_rows, generator=gen) < match_prob,
        target,
        torch.randint(0, 50, (num_rows,), generator=gen),
    )
    got = accept_greedy(target.to(DEV), draft.to(DEV), cu, max_rows=max_rows)
    want = accept_greedy_ref(target, draft, cu.cpu(), max_rows=max_rows)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_greedy_accept_semantics():
    # Sequence 0: drafts 5, 6 match, 9 != 7 -> accepts 2, emits 5 6 7.
    # Sequence 1: one row (AR) -> emits the target token. Sequence 2: padding.
    target = torch.tensor([5, 6, 7, 8, 3], device=DEV)
    draft = torch.tensor([5, 6, 9, -1, -1], device=DEV)
    num_acc, out = accept_greedy(target, draft, _rows([4, 1, 0]), max_rows=4)
    assert num_acc.tolist() == [2, 0, 0]
    assert out.tolist() == [[5, 6, 7, -1], [3, -1, -1, -1], [-1, -1, -1, -1]]


def _dists(num_rows: int, vocab: int, gen: torch.Generator, sharp: float) -> torch.Tensor:
    probs = torch.softmax(torch.randn(num_rows, vocab, generator=gen) * sharp, -1)
    probs[probs < 0.01] = 0.0  # as top-p / min-p leave them: zeros in the support
    return (probs / probs.sum(-1, keepdim=True)).to(DEV)


@settings(max_examples=15)
@given(
    row_counts=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    vocab=st.integers(2, 300),
    with_draft_probs=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rejection_accept_matches_reference(row_counts, vocab, with_draft_probs, seed):
    gen = torch.Generator().manual_seed(seed)
    cu = _rows(row_counts)
    num_rows = sum(row_counts)
    p = _dists(num_rows, vocab, gen, 2.0)
    q = _dists(num_rows, vocab, gen, 2.0) if with_draft_probs else None
    sampler = q if q is not None else p
    drafts = (
        torch.multinomial(sampler.cpu(), 1, generator=gen).squeeze(1)
        if num_rows
        else (torch.zeros(0, dtype=torch.int64))
    )
    u = torch.rand(num_rows, generator=gen)
    ru = torch.rand(num_rows, generator=gen)
    args = (p, q, drafts.to(DEV), cu, u.to(DEV), ru.to(DEV))
    got = accept_rejection(*args, max_rows=5)
    want = accept_rejection_ref(*args, max_rows=5)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_accept_keeps_the_target_distribution(with_draft_probs):
    """First emitted token of a 2-row sequence, over many draws, follows p exactly:
    P(x) = q(x) min(1, p/q) + P(reject) * residual(x) = p(x). On the CPU the reference draws
    (the interpreter is too slow for thousands of programs); the kernel equals it bit for bit
    in test_rejection_accept_matches_reference."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 5, 6000
    p1 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q1 = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1]) if with_draft_probs else None
    p = p1.repeat(trials, 2).view(2 * trials, vocab)
    cu = torch.arange(0, 2 * trials + 1, 2, dtype=torch.int32)
    if with_draft_probs:
        drafts = torch.multinomial(q1, trials, replacement=True, generator=gen)
        q = q1.repeat(trials, 2).view(2 * trials, vocab)
    else:
        drafts, q = torch.full((trials,), 1), None  # a fixed draft token: the point-mass rule
    draft_ids = torch.stack([drafts, torch.zeros_like(drafts)], 1).reshape(-1)
    u, ru = torch.rand(2 * trials, generator=gen), torch.rand(2 * trials, generator=gen)
    accept = accept_rejection if DEV == "cuda" else accept_rejection_ref
    _, out = accept(
        p.to(DEV),
        None if q is None else q.to(DEV),
        draft_ids.to(DEV),
        cu.to(DEV),
        u.to(DEV),
        ru.to(DEV),
        max_rows=2,
    )
    freq = torch.bincount(out[:, 0].cpu().long(), minlength=vocab).double() / trials
    assert (freq - p1.double()).abs().max() < 0.025  # ~4 standard errors at 6000 draws
