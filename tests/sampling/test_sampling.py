"""Batched device sampling against per-row references: penalties, filtering, seeded draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor import sampling
from executor.sampling import SamplingTensors
from scheduler.plan import SamplingSpec
from tests.sampling import reference

VOCAB = 12


def build(specs, req_ids=None, steps=None, *, vocab=VOCAB, base_seed=0, device="cpu"):
    n = len(specs)
    return SamplingTensors.build(
        specs,
        list(range(n)) if req_ids is None else req_ids,
        [0] * n if steps is None else steps,
        vocab_size=vocab,
        base_seed=base_seed,
        device=device,
    )


specs_strategy = st.builds(
    SamplingSpec,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
    top_k=st.sampled_from([0, 1, 3, 5, VOCAB, VOCAB + 4]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
)
# Distinct, well separated logits: ties would make argmax/top-k order a matter of convention.
logit_rows = st.permutations(range(VOCAB)).map(
    lambda perm: [0.37 * (v - VOCAB / 2) + 0.011 * i for i, v in enumerate(perm)]
)


@given(rows=st.lists(st.tuples(specs_strategy, logit_rows), min_size=1, max_size=6))
def test_process_logits_matches_reference(rows):
    specs = [s for s, _ in rows]
    logits = torch.tensor([lg for _, lg in rows], dtype=torch.float32)
    probs = sampling.process_logits(logits, build(specs))
    for i, (spec, row) in enumerate(rows):
        expected = reference.distribution(row, spec)
        assert np.allclose(probs[i].double().numpy(), expected, atol=1e-5), (spec, i)
        # Filtered tokens have exactly zero probability.
        assert ((probs[i] > 0).numpy() == (expected > 0)).all()


@given(
    rows=st.lists(
        st.tuples(
            specs_strategy,
            st.lists(st.floats(-5, 5, width=32), min_size=VOCAB, max_size=VOCAB),
            st.lists(st.integers(0, 3), min_size=VOCAB, max_size=VOCAB),
            st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_penalties_match_reference(rows):
    specs = [r[0] for r in rows]
    logits = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    counts = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    prompt = torch.tensor([r[3] for r in rows], dtype=torch.bool)
    out = sampling.apply_penalties(logits, build(specs), counts, prompt)
    for i, (spec, row, cnt, pm) in enumerate(rows):
        expected = reference.penalise(row, spec, cnt, pm)
        assert np.allclose(out[i].numpy(), expected, atol=1e-5)


def test_no_penalties_is_identity():
    logits = torch.randn(3, VOCAB)
    counts = torch.ones(3, VOCAB, dtype=torch.int32)
    out = sampling.apply_penalties(logits, build([SamplingSpec()] * 3), counts, counts > 0)
    assert out is logits


@given(rows=st.lists(st.tuples(specs_strategy, logit_rows), min_size=1, max_size=8))
def test_greedy_rows_take_the_argmax(rows):
    specs = [s for s, _ in rows]
    logits = torch.tensor([lg for _, lg in rows], dtype=torch.float32)
    tokens = sampling.sample(logits, build(specs))
    for i, spec in enumerate(specs):
        probs = reference.distribution(rows[i][1], spec)
        if spec.greedy:
            assert int(tokens[i]) == int(logits[i].argmax())
        assert probs[int(tokens[i])] > 0  # never a filtered token


@given(
    data=st.data(),
    target=specs_strategy.filter(lambda s: not s.greedy),
    step=st.integers(0, 2**40),
)
def test_seeded_row_reproducible_in_any_batch(data, target, step):
    """Same seed and step give the same token alone, at another position, among other rows."""
    target_logits = torch.tensor(data.draw(logit_rows))
    target = SamplingSpec(**{**_fields(target), "seed": data.draw(st.integers(0, 2**40))})
    alone = sampling.sample(target_logits[None], build([target], [99], [step]))
    others = data.draw(st.lists(st.tuples(specs_strategy, logit_rows), max_size=6))
    pos = data.draw(st.integers(0, len(others)))
    specs = [s for s, _ in others]
    specs.insert(pos, target)
    logits = [torch.tensor(lg) for _, lg in others]
    logits.insert(pos, target_logits)
    req_ids = data.draw(st.lists(st.integers(0, 1000), min_size=len(specs), max_size=len(specs)))
    req_ids[pos] = 5  # a seeded request's draws do not depend on its req_id either
    steps = [step if i == pos else i for i in range(len(specs))]
    batched = sampling.sample(torch.stack(logits), build(specs, req_ids, steps, base_seed=7))
    assert int(batched[pos]) == int(alone[0])


def _fields(spec: SamplingSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def test_unseeded_rows_follow_base_seed_and_req_id():
    logits = torch.zeros(64, VOCAB)  # uniform: every draw is informative
    spec = [SamplingSpec(temperature=1.0)] * 64
    steps = list(range(64))

    def draw(req_id, base_seed):
        return sampling.sample(logits, build(spec, [req_id] * 64, steps, base_seed=base_seed))

    assert torch.equal(draw(3, 0), draw(3, 0))
    assert not torch.equal(draw(3, 0), draw(4, 0))
    assert not torch.equal(draw(3, 0), draw(3, 1))


CONFIGS = [
    SamplingSpec(temperature=1.0),
    SamplingSpec(temperature=0.6),
    SamplingSpec(temperature=1.3, top_k=4),
    SamplingSpec(temperature=1.0, top_p=0.7),
    SamplingSpec(temperature=0.9, min_p=0.1),
    SamplingSpec(temperature=1.2, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("spec", CONFIGS, ids=lambda s: repr(s)[12:60])
def test_draws_follow_the_distribution(spec):
    """20k seeded draws of one row (steps 0..N-1) against the reference distribution."""
    num_draws = 20_000
    row = [0.45 * ((7 * v) % VOCAB) - 2.0 for v in range(VOCAB)]
    spec = SamplingSpec(**{**_fields(spec), "seed": 1234})
    st_ = build([spec] * num_draws, steps=list(range(num_draws)))
    tokens = sampling.sample(torch.tensor([row] * num_draws), st_)
    observed = np.bincount(tokens.numpy(), minlength=VOCAB)
    expected_p = reference.distribution(row, spec)
    assert (observed[expected_p == 0] == 0).all()
    support = expected_p > 0
    expected = expected_p[support] * num_draws
    chi2 = float(((observed[support] - expected) ** 2 / expected).sum())
    assert chi2 < reference.chi_square_limit(int(support.sum()) - 1), (observed, expected)


def test_sample_from_probs_accepts_unnormalised_weights():
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0]] * 8000)
    st_ = build([SamplingSpec(temperature=1.0, seed=5)] * 8000, steps=list(range(8000)))
    tokens = sampling.sample_from_probs(weights, st_)
    counts = np.bincount(tokens.numpy(), minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[3] / 8000 - 0.75) < 0.02


def test_uniforms_reproducible_and_separate_from_draws():
    specs = [SamplingSpec(temperature=1.0, seed=9), SamplingSpec(temperature=1.0, seed=9)]
    a = sampling.uniforms(build(specs, steps=[4, 5]), 3)
    b = sampling.uniforms(build(specs[:1], steps=[5]), 3)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    accept = sampling.uniforms(build(specs[:1], steps=[5]), 3)
    residual = sampling.uniforms(build(specs[:1], steps=[5]), 3, sampling.Stream.RESIDUAL)
    assert not torch.equal(accept, residual)


def test_compute_logprobs():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    token_ids = torch.tensor([0, 3, 5, 11])
    chosen, top_ids, top_lp = sampling.compute_logprobs(logits, token_ids, 3)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(chosen.double(), ref[torch.arange(4), token_ids], atol=1e-6)
    assert torch.equal(top_ids, ref.argsort(-1, descending=True)[:, :3])
    assert torch.allclose(top_lp.double(), ref.gather(1, top_ids), atol=1e-6)
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    chosen0, ids0, lp0 = sampling.compute_logprobs(logits, token_ids, 0)
    assert ids0.shape == (4, 0) and lp0.shape == (4, 0) and torch.equal(chosen0, chosen)


@given(
    emitted=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(-1, VOCAB - 1), max_size=4)),
        max_size=6,
    )
)
def test_count_tables(emitted):
    """update_output_counts / mark_tokens / gather_row_counts / clear_slots vs Python counting."""
    num_slots = 4
    counts = torch.zeros(num_slots, VOCAB, dtype=torch.int32)
    mask = torch.zeros(num_slots, VOCAB, dtype=torch.bool)
    expected = np.zeros((num_slots, VOCAB), dtype=np.int64)
    for slot, ids in emitted:
        padded = torch.tensor([[*ids, -1]])
        sampling.update_output_counts(counts, torch.tensor([slot]), padded)
        sampling.mark_tokens(mask, torch.tensor([slot]), padded)
        for t in ids:
            if t >= 0:
                expected[slot, t] += 1
    assert (counts.numpy() == expected).all()
    assert (mask.numpy() == (expected > 0)).all()
    drafts = torch.tensor([[2, 2, -1], [-1, -1, -1], [0, 5, 7]])
    rows = sampling.gather_row_counts(counts, torch.tensor([1, 1, 3]), drafts)
    assert rows[0, 2] == expected[1, 2] + 2 and rows[2, 7] == expected[3, 7] + 1
    assert (rows[1].numpy() == expected[1]).all()
    assert (counts.numpy() == expected).all()  # the slot table is untouched
    sampling.clear_slots(counts, torch.tensor([1, 3]))
    sampling.clear_slots(mask, torch.tensor([1, 3]))
    assert int(counts[[1, 3]].abs().sum()) == 0 and not bool(mask[[1, 3]].any())


def test_mixed_batch_equals_separate_batches():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=gen)
    specs = [
        SamplingSpec(temperature=t, top_p=0.9, seed=i) for i, t in enumerate([0, 1, 0, 0.5, 1, 0])
    ]
    mixed = sampling.sample(logits, build(specs, steps=[3] * 6))
    sampled_rows = [i for i, s in enumerate(specs) if not s.greedy]
    alone = sampling.sample(
        logits[sampled_rows], build([specs[i] for i in sampled_rows], steps=[3] * 3)
    )
    assert torch.equal(mixed[sampled_rows], alone)
    assert torch.equal(mixed[[0, 2, 5]], logits[[0, 2, 5]].argmax(-1))


@pytest.mark.gpu
def test_gpu_matches_cpu():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 4096, generator=gen) * 3
    specs = [
        SamplingSpec(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, seed=i)
        if i % 3
        else SamplingSpec()
        for i in range(32)
    ]
    cpu_st = build(specs, steps=list(range(32)), vocab=4096)
    gpu_st = build(specs, steps=list(range(32)), vocab=4096, device="cuda")
    cpu = sampling.sample(logits, cpu_st)
    gpu = sampling.sample(logits.cuda(), gpu_st).cpu()
    assert (cpu == gpu).float().mean().item() >= 0.95  # rounding may flip a near-tie
    assert torch.equal(sampling.uniforms(cpu_st, 8), sampling.uniforms(gpu_st, 8).cpu())
