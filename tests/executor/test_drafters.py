"""Unit tests of the draft-model drafter (catch-up, commit, batching, draft distributions) and the
synthetic acceptance drafter (its statistics against the acceptance profile)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DraftModelDrafter
from executor.drafters.synthetic import SyntheticDrafter, load_cohort
from executor.loader import load_model
from executor.model import Model
from scheduler.plan import Mode
from scheduler.request import RequestSpec
from tests.executor.test_spec_exactness import (
    ACCEPTANCE_PROFILE,
    GREEDY,
    next_token_probs,
    run_requests,
)
from tests.fixtures.tiny_models import make_tiny_model

BLOCK_SIZE = 4  # small blocks: contexts cross many block boundaries
NUM_BLOCKS = 48
MAX_MODEL_LEN = 160
MAX_SLOTS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_drafter(model: Model, block_ids_per_slot: dict[int, list[int]], seed: int = 0):
    drafter = DraftModelDrafter(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_slots=MAX_SLOTS,
        max_model_len=MAX_MODEL_LEN,
        seed=seed,
    )
    table = np.zeros((MAX_SLOTS, NUM_BLOCKS), dtype=np.int32)
    for slot, ids in block_ids_per_slot.items():
        table[slot, : len(ids)] = ids
    drafter.bind_block_tables(table)
    return drafter


def draft_kv(drafter: DraftModelDrafter, slot: int, num_positions: int) -> torch.Tensor:
    """The drafter's K and V of the slot's first positions: [layers, 2, positions, heads, dim]."""
    pos = np.arange(num_positions)
    blocks = torch.from_numpy(drafter.block_tables[slot, pos // BLOCK_SIZE].astype(np.int64))
    offsets = torch.from_numpy(pos % BLOCK_SIZE)
    return torch.stack(
        [
            torch.stack([k[blocks, offsets], v[blocks, offsets]])
            for k, v in zip(drafter.kv.k, drafter.kv.v)
        ]
    )


def propose_one(drafter, slot, context, num_draft, temperature=0.0, gen_seed=None):
    if gen_seed is not None:
        drafter.generator.manual_seed(gen_seed)
    req = DraftRequest(slot, list(context), num_draft, temperature=temperature or 1.0)
    return drafter.propose([req], [temperature == 0.0])


def other_than(token: int) -> int:
    """A token that differs from `token`: the correction after a rejected draft."""
    return 1 if token != 1 else 2


# -- draft-model drafter ----------------------------------------------------------------------
OPS = st.lists(
    st.tuples(st.sampled_from(["ar", "spec"]), st.integers(1, 7), st.integers(0, 7)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), prompt_len=st.integers(1, 30), ops=OPS)
def test_drafting_after_catch_up_equals_drafting_from_a_fresh_prefill(
    draft_model, seed, prompt_len, ops
):
    """A request alternates AR rounds (the drafter lags) and SPEC rounds with any accepted count;
    every proposal equals the one of a fresh drafter that prefills the same context, and the
    valid draft KV equals the fresh drafter's. Sampled drafts (seeded alike) compare the draft
    distributions too."""
    rng = np.random.default_rng(seed)
    vocab = draft_model.config.vocab_size
    slot = 2
    # the incremental drafter: scattered block ids and garbage in every cache entry, so a
    # position it forgot to (re)compute cannot match
    inc = make_drafter(draft_model, {slot: rng.permutation(NUM_BLOCKS).tolist()})
    for t in (*inc.kv.k, *inc.kv.v):
        t.normal_()
    fresh = make_drafter(draft_model, {0: list(range(NUM_BLOCKS))})
    context = rng.integers(1, vocab, prompt_len).tolist()
    inc.setup(slot, context)
    temperature = 0.7
    for kind, n, a in ops:
        if kind == "ar":
            for _ in range(n):
                context.append(int(rng.integers(1, vocab)))
                inc.commit(slot, context, 0, 0)
            continue
        gen_seed = int(rng.integers(2**31))
        got = propose_one(inc, slot, context, n, temperature, gen_seed)
        fresh.setup(0, context)
        want = propose_one(fresh, 0, context, n, temperature, gen_seed)
        assert got.tokens == want.tokens
        torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=1e-4)
        written = len(context) + n - 1  # context and all but the last draft
        torch.testing.assert_close(
            draft_kv(inc, slot, written), draft_kv(fresh, 0, written), atol=1e-5, rtol=1e-4
        )
        # the target accepts a of the n drafts; a rejected position emits another token
        drafts = got.tokens[0]
        num_acc = min(a, n)
        nxt = int(rng.integers(1, vocab))
        if num_acc < n and nxt == drafts[num_acc]:
            nxt = nxt % (vocab - 1) + 1
        context += [*drafts[:num_acc], nxt]
        inc.commit(slot, context, num_acc, n)
    fresh.setup(0, context)
    gen_seed = int(rng.integers(2**31))
    got = propose_one(inc, slot, context, 3, temperature, gen_seed)
    want = propose_one(fresh, 0, context, 3, temperature, gen_seed)
    assert got.tokens == want.tokens


def test_commit_keeps_draft_kv_up_to_the_accepted_drafts(draft_model):
    """After a SPEC round of d drafts with a accepted from L committed tokens the drafter holds
    L + min(a, d - 1) positions; the next proposal catches up exactly the rest."""
    d = 5
    cases = [(0, 0), (2, 0), (4, 0), (5, 1)]  # (accepted, catch-up rows next round)
    for num_acc, catchup in cases:
        drafter = make_drafter(draft_model, {1: list(range(NUM_BLOCKS))})
        context = list(range(10, 30))
        drafter.setup(1, context)
        first = propose_one(drafter, 1, context, d)
        assert first.extra["num_catchup_rows"] == len(context) - 1  # the whole prompt
        prev_len = len(context)
        context += [*first.tokens[0][:num_acc], 7]
        drafter.commit(1, context, num_acc, d)
        assert drafter.kv_len[1] == prev_len + min(num_acc, d - 1)
        nxt = propose_one(drafter, 1, context, 2)
        assert nxt.extra["num_catchup_rows"] == catchup
        if catchup == 0:
            assert nxt.catchup_ms == 0.0
    # the last round rejects its first draft; then AR rounds: one token of lag per round
    context.append(other_than(nxt.tokens[0][0]))
    drafter.commit(1, context, 0, 2)
    for _ in range(3):
        context.append(11)
        drafter.commit(1, context, 0, 0)
    lagged = propose_one(drafter, 1, context, 2)
    assert lagged.extra["num_catchup_rows"] == 3
    assert lagged.catchup_ms >= 0.0  # a measured time (the extra cost of the first step)


def test_batched_requests_at_different_lags_match_their_solo_proposals(draft_model):
    """One batch mixes a fresh request, a lagging one and one with no catch-up, different
    depths, greedy and sampled: each gets what it would get alone."""
    rng = np.random.default_rng(3)
    ids = rng.permutation(NUM_BLOCKS).tolist()
    tables = {0: ids[:16], 1: ids[16:32], 3: ids[32:]}
    batch_drafter = make_drafter(draft_model, tables)
    contexts = {s: rng.integers(1, 300, 20 + 5 * s).tolist() for s in tables}
    for s, ctx in contexts.items():
        batch_drafter.setup(s, ctx)
    # slot 1 lags by AR rounds after a first proposal; slot 3 is fully caught up
    for s in (1, 3):
        out = propose_one(batch_drafter, s, contexts[s], 1)
        contexts[s] = contexts[s] + [other_than(out.tokens[0][0])]  # the draft is rejected
        batch_drafter.commit(s, contexts[s], 0, 1)
    contexts[1] += [9, 8, 7]
    for n in (1, 2, 3):
        batch_drafter.commit(1, contexts[1][: len(contexts[1]) - 3 + n], 0, 0)
    reqs = [
        DraftRequest(0, contexts[0], 4),
        DraftRequest(1, contexts[1], 6),
        DraftRequest(3, contexts[3], 2, temperature=0.9),
    ]
    batch = batch_drafter.propose(reqs, [True, True, False])
    assert [len(t) for t in batch.tokens] == [4, 6, 2]
    assert batch.extra["num_catchup_rows"] == (20 - 1) + 3
    assert batch.probs is not None and batch.probs.shape == (12, draft_model.config.vocab_size)
    torch.testing.assert_close(batch.probs.sum(-1), torch.ones(12))
    # greedy rows are the point mass of the drafted token
    for row, tok in enumerate(batch.tokens[0] + batch.tokens[1]):
        assert batch.probs[row, tok] == 1.0
    for row, tok in enumerate(batch.tokens[2], start=10):
        assert batch.probs[row, tok] > 0.0
    for r, got in zip(reqs[:2], batch.tokens[:2]):
        solo = make_drafter(draft_model, {0: list(range(NUM_BLOCKS))})
        solo.setup(0, r.context)
        assert propose_one(solo, 0, r.context, r.num_draft).tokens[0] == got


def test_sampled_draft_distribution_is_the_softmax_at_the_request_temperature(draft_model):
    context = list(range(40, 60))
    drafter = make_drafter(draft_model, {0: list(range(NUM_BLOCKS))})
    drafter.setup(0, context)
    for temperature in (0.5, 1.3):
        out = propose_one(drafter, 0, context, 1, temperature)
        want = next_token_probs(draft_model, context, temperature).float()
        torch.testing.assert_close(out.probs[0], want, atol=1e-5, rtol=1e-4)
    greedy = propose_one(drafter, 0, context, 3)
    assert greedy.probs is None  # all greedy: no distributions needed
    assert greedy.tokens[0][0] == int(next_token_probs(draft_model, context, 1.0).argmax())


def test_a_deferred_proposal_holds_its_drafts_on_the_device_until_resolved(draft_model):
    """`propose(defer=True)` returns the drafts on the device (request order) and fills the host
    tokens and timings only at `resolve`; they equal an undeferred proposal's. A synthetic
    drafter paying this drafter's cost keeps its placeholders and takes the timings at
    resolve."""
    rng = np.random.default_rng(3)
    vocab = draft_model.config.vocab_size
    contexts = {s: rng.integers(1, vocab, 12 + 5 * s).tolist() for s in (0, 1, 2)}
    blocks = {s: list(range(16 * s, 16 * s + 16)) for s in contexts}
    pair = [make_drafter(draft_model, blocks), make_drafter(draft_model, blocks)]
    for d in pair:
        for s, ctx in contexts.items():
            d.setup(s, ctx)
    reqs = [DraftRequest(s, contexts[s], n) for s, n in ((0, 3), (1, 0), (2, 5))]
    deferred = pair[0].propose(reqs, [True] * 3, defer=True)
    assert deferred.tokens is None and deferred.tokens_dev.shape == (8,)
    plain = pair[1].propose(reqs, [True] * 3)
    assert plain.resolver is None and [len(t) for t in plain.tokens] == [3, 0, 5]
    assert deferred.tokens_dev.tolist() == [t for toks in plain.tokens for t in toks]
    deferred.resolve()
    assert deferred.tokens == plain.tokens and deferred.resolver is None
    assert deferred.extra["num_catchup_rows"] == plain.extra["num_catchup_rows"] > 0
    deferred.resolve()  # (a second resolve changes nothing)
    assert deferred.tokens == plain.tokens

    inner = make_drafter(draft_model, blocks)
    paying = SyntheticDrafter(ACCEPTANCE_PROFILE, "code", seed=1, inner=inner)
    for s, ctx in contexts.items():
        paying.setup(s, ctx)
    batch = paying.propose(reqs, [True] * 3, defer=True)
    assert [len(t) for t in batch.tokens] == [3, 0, 5] and len(batch.forced_accept) == 3
    assert batch.extra == {} and batch.resolver is not None  # the cost drafter still runs
    batch.resolve()
    assert batch.extra["num_catchup_rows"] == plain.extra["num_catchup_rows"]


def test_release_and_setup_reset_the_slot(draft_model):
    drafter = make_drafter(draft_model, {0: list(range(NUM_BLOCKS))})
    drafter.setup(0, list(range(1, 20)))
    propose_one(drafter, 0, list(range(1, 20)), 3)
    assert drafter.kv_len[0] > 0
    drafter.release(0)
    assert drafter.kv_len[0] == 0
    other = list(range(100, 110))
    drafter.setup(0, other)
    assert propose_one(drafter, 0, other, 1).extra["num_catchup_rows"] == len(other) - 1


def test_drafter_without_block_table_or_beyond_its_positions_is_an_error(draft_model):
    drafter = DraftModelDrafter(
        draft_model, num_blocks=8, block_size=4, max_slots=1, max_model_len=16
    )
    with pytest.raises(RuntimeError, match="block table"):
        drafter.propose([DraftRequest(0, [1, 2], 1)], [True])
    drafter.bind_block_tables(np.arange(8, dtype=np.int32)[None, :])
    drafter.setup(0, [1] * 14)
    with pytest.raises(ValueError, match="covers 16"):
        drafter.propose([DraftRequest(0, [1] * 14, 4)], [True])


# -- synthetic drafter ------------------------------------------------------------------------
def stationary_mean_and_chain(classes, num_draft: int) -> tuple[float, float]:
    """Exact per-position acceptance in the stationary state, and the expected accepted chain
    length of `num_draft` drafts starting in it:
        P(positions 1..j accepted) = pi D (T D)^(j-1) 1,  D = diag(easy, hard),
    averaged over the classes by weight."""
    total = sum(c.weight for c in classes)
    mean = chain = 0.0
    for c in classes:
        pi = np.array([c.stationary_easy, 1.0 - c.stationary_easy])
        acc = np.diag([c.easy, c.hard])
        trans = np.array(
            [[1 - c.p_easy_to_hard, c.p_easy_to_hard], [c.p_hard_to_easy, 1 - c.p_hard_to_easy]]
        )
        row = pi @ acc
        expected = 0.0
        for _ in range(num_draft):
            expected += row.sum()
            row = row @ trans @ acc
        mean += c.weight / total * float((pi @ acc).sum())
        chain += c.weight / total * expected
    return mean, chain


@pytest.mark.parametrize("cohort", ["code", "prose"])
def test_synthetic_per_position_acceptance_matches_the_stationary_mean(cohort):
    drafter = SyntheticDrafter(ACCEPTANCE_PROFILE, cohort, seed=5)
    num_reqs, num_tokens = 100, 400
    outcomes = []
    for slot in range(num_reqs):
        prompt = [1] * 7
        drafter.setup(slot, prompt)
        # one single-draft query per generated token index (queries do not move the trace)
        reqs = [DraftRequest(slot, prompt + [2] * k, 1) for k in range(1, num_tokens)]
        outcomes += drafter.propose(reqs, [True] * len(reqs)).forced_accept
        drafter.release(slot)
    mean, _ = stationary_mean_and_chain(load_cohort(ACCEPTANCE_PROFILE, cohort), 1)
    # states persist ~1 / (p_eh + p_he) tokens: the effective sample is ~10x smaller than
    # 40k; 0.02 is about 4 standard errors
    assert abs(np.mean(outcomes) - mean) < 0.02


def test_synthetic_chain_length_matches_the_markov_chain_over_classes():
    """Mixed cohort (two classes by weight): the accepted chain of 7 drafts from the first
    decode round, over many requests, against the exact expectation."""
    drafter = SyntheticDrafter(ACCEPTANCE_PROFILE, "mixed", seed=9)
    num_reqs = 3000
    accepted = []
    for _ in range(num_reqs):
        drafter.setup(0, [1, 2, 3])
        accepted += drafter.propose([DraftRequest(0, [1, 2, 3, 4], 7)], [True]).forced_accept
    _, expected = stationary_mean_and_chain(load_cohort(ACCEPTANCE_PROFILE, "mixed"), 7)
    std_err = np.std(accepted) / np.sqrt(num_reqs)
    assert abs(np.mean(accepted) - expected) < 4 * std_err
    assert 0 in accepted and 7 in accepted


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), depths=st.lists(st.integers(1, 15), min_size=1, max_size=12))
def test_synthetic_trace_does_not_depend_on_how_rounds_split_it(seed, depths):
    """Chain semantics on a per-token trace: a round's accepted count is the run of accepted
    single positions from its first token, whatever depths and AR rounds came before."""
    chained = SyntheticDrafter(ACCEPTANCE_PROFILE, "prose", seed=seed)
    single = SyntheticDrafter(ACCEPTANCE_PROFILE, "prose", seed=seed)
    prompt = [3] * 5
    chained.setup(0, prompt)
    single.setup(0, prompt)
    context = [*prompt, 4]
    for depth in depths:
        batch = chained.propose([DraftRequest(0, context, depth)], [True])
        assert batch.tokens == [[context[-1]] * depth]
        num_acc = batch.forced_accept[0]
        run = 0
        while (
            run < depth
            and single.propose([DraftRequest(0, context + [0] * run, 1)], [True]).forced_accept[0]
        ):
            run += 1
        assert num_acc == run
        context += [4] * (num_acc + 1)
        chained.commit(0, context, num_acc, depth)
        if depth % 3 == 0:  # an AR round in between
            context.append(4)
            chained.commit(0, context, 0, 0)


def test_synthetic_trace_of_a_request_does_not_depend_on_admission_order():
    prompts = [[7, 8, 9], [1, 2], [7, 8, 9], [4] * 6]  # a repeated prompt gets its own trace
    first = SyntheticDrafter(ACCEPTANCE_PROFILE, "mixed", seed=2)
    second = SyntheticDrafter(ACCEPTANCE_PROFILE, "mixed", seed=2)
    order = [3, 1, 0, 2]  # admitted in another order, into other slots

    def trace(drafter, slot, prompt):
        reqs = [DraftRequest(slot, prompt + [0] * k, 1) for k in range(1, 200)]
        return drafter.propose(reqs, [True] * len(reqs)).forced_accept

    for slot, prompt in enumerate(prompts):
        first.setup(slot, prompt)
    for slot, i in enumerate(order):
        second.setup(slot, prompts[i])
    traces = [trace(first, slot, p) for slot, p in enumerate(prompts)]
    for slot, i in enumerate(order):
        assert trace(second, slot, prompts[i]) == traces[i]
    assert traces[0] != traces[2]


def test_synthetic_profile_errors_and_labels():
    with pytest.raises(ValueError, match="no cohort 'poetry'"):
        SyntheticDrafter(ACCEPTANCE_PROFILE, "poetry", seed=0)
    drafter = SyntheticDrafter(ACCEPTANCE_PROFILE, "code", seed=0)
    assert drafter.name == "synthetic" and not drafter.has_probs


def test_executor_reports_the_synthetic_accepted_counts(tmp_path_factory):
    """Through the scheduler and the round executor: every SPEC round reports exactly the
    drafter's forced count, emits that many tokens plus one, and the KV pool ends idle."""
    target_dir = make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0)
    models = {"target": load_model(target_dir)}
    forced_log: list[list[int]] = []
    original = SyntheticDrafter.propose

    def recording_propose(self, requests, greedy, defer=False):
        batch = original(self, requests, greedy, defer)
        forced_log.append(list(batch.forced_accept))
        return batch

    rounds: list[tuple] = []
    rng = np.random.default_rng(4)
    specs = [
        RequestSpec(
            req_id=i,
            prompt_token_ids=tuple(rng.integers(1, 300, 5 + i).tolist()),
            sampling=GREEDY,
            max_tokens=60,
        )
        for i in range(4)
    ]
    SyntheticDrafter.propose = recording_propose
    try:
        log = run_requests(
            models, specs, "synthetic", rng, p_spec=0.7, on_plan=lambda p, s: rounds.append(p)
        )
    finally:
        SyntheticDrafter.propose = original
    spec_rounds = [p for p in rounds if any(r.mode == Mode.SPEC for r in p.reqs)]
    assert len(spec_rounds) == len(forced_log) > 5
    assert log.num_drafted > 100
    forced = [
        min(f, r.num_draft)
        for p, fs in zip(spec_rounds, forced_log)
        for f, r in zip(fs, [r for r in p.reqs if r.mode == Mode.SPEC])
    ]
    assert log.num_accepted == sum(forced) > 0
    assert all(len(out) == 60 for out in log.outputs.values())


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    cohort=st.sampled_from(["code", "prose", "mixed"]),
    prompts=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), min_size=1, max_size=4),
    chains=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=8),
)
def test_simulator_replays_the_synthetic_drafters_traces(seed, cohort, prompts, chains):
    """The simulator keyed by the run's prompts accepts exactly what the synthetic drafter did:
    the benchmark's simulated points replay its runs' acceptance."""
    from scheduler.sim.acceptance_model import AcceptanceState, load_cohorts, trace_key

    drafter = SyntheticDrafter(ACCEPTANCE_PROFILE, cohort, seed=seed)
    keys = tuple(trace_key(p) for p in prompts)
    state = AcceptanceState(load_cohorts(ACCEPTANCE_PROFILE)[cohort], seed, keys)
    for req_id, prompt in enumerate(prompts):
        if prompt in prompts[:req_id]:
            continue  # a repeated prompt is a second set-up there: another trace
        drafter.setup(req_id, prompt)
        state.enter(req_id, req_id)
        for first_token, depth in chains:
            context = prompt + [0] * first_token
            real = drafter.propose([DraftRequest(req_id, context, depth)], [True])
            assert real.forced_accept[0] == state.accepted(req_id, first_token, depth)
