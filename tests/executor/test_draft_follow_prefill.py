"""The draft model following prefill chunks (`follow_prefill`, the round that prefills them)
against catching up on the whole prompt at the first speculating round: same draft KV, same
proposals; chunks that do not continue the draft KV are left to the catch-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import wide_passes
from tests.executor.test_draft_catchup import MAX_MODEL_LEN, MAX_SLOTS, make_drafter
from tests.executor.test_drafters import draft_kv

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    prompts=st.lists(st.integers(2, 60), min_size=1, max_size=MAX_SLOTS),
    chunk=st.integers(1, 24),
    drafts=st.integers(1, 5),
)
def test_following_prefill_chunks_equals_catching_up_on_the_prompt(
    draft_model, seed, prompts, chunk, drafts
):
    rng = np.random.default_rng(seed)
    vocab = draft_model.config.vocab_size
    catchup, follower = make_drafter(draft_model), make_drafter(draft_model)
    contexts = [rng.integers(1, vocab, n).tolist() for n in prompts]
    for d in (catchup, follower):
        for s, ctx in enumerate(contexts):
            d.setup(s, ctx)
    # the prompts in chunks of `chunk` rows, several requests per round, as prefill rounds run
    done = [0] * len(contexts)
    while any(a < len(c) for a, c in zip(done, contexts)):
        live = [s for s, c in enumerate(contexts) if done[s] < len(c)]
        rows = follower.follow_prefill(
            live,
            [done[s] for s in live],
            [contexts[s][done[s] : done[s] + chunk] for s in live],
        )
        assert rows == sum(min(chunk, len(contexts[s]) - done[s]) for s in live)
        for s in live:
            done[s] = min(done[s] + chunk, len(contexts[s]))
    # the prefill's last row samples the first token; then the first speculating round
    for ctx in contexts:
        ctx.append(int(rng.integers(1, vocab)))
    reqs = [DraftRequest(s, list(c), drafts) for s, c in enumerate(contexts)]
    want = catchup.propose(reqs, [True] * len(reqs))
    got = follower.propose(reqs, [True] * len(reqs))
    assert got.tokens == want.tokens
    assert want.extra["num_catchup_rows"] == sum(prompts)  # the whole prompts
    assert got.extra["num_catchup_rows"] == 0  # only each request's last committed token
    assert np.array_equal(catchup.kv_len, follower.kv_len)
    for s in range(len(contexts)):
        n = int(catchup.kv_len[s])
        torch.testing.assert_close(draft_kv(follower, s, n), draft_kv(catchup, s, n))


def test_chunks_that_do_not_continue_the_draft_kv_are_left_to_the_catch_up(draft_model):
    drafter = make_drafter(draft_model)
    prompt = list(range(1, 41))
    drafter.setup(0, prompt)
    drafter.setup(1, prompt)
    # slot 0 starts at its beginning; slot 1's chunk starts past what the drafter has
    assert drafter.follow_prefill([0, 1], [0, 16], [prompt[:16], prompt[16:32]]) == 16
    assert drafter.kv_len.tolist()[:2] == [16, 0]
    assert drafter.follow_prefill([0], [0], [prompt[:16]]) == 0  # already computed: skipped
    assert drafter.follow_prefill([0], [16], [[]]) == 0  # nothing to compute
    # a chunk past the drafter's positions is not taken
    assert drafter.follow_prefill([0], [16], [list(range(MAX_MODEL_LEN))]) == 0
    assert drafter.kv_len[0] == 16


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 40), max_size=8), cap=st.integers(1, 32))
def test_wide_passes_cover_every_row_once_in_order_and_fill_all_but_the_last(lens, cap):
    passes = wide_passes(lens, cap)
    pieces = [piece for p in passes for piece in p]
    # every sequence's rows once, in order: its pieces are consecutive and tile 0..n
    rows = [(k, a + i) for k, a, n in pieces for i in range(n)]
    assert rows == [(k, i) for k, n in enumerate(lens) for i in range(n)]
    sizes = [sum(n for _, _, n in p) for p in passes]
    assert all(s == cap for s in sizes[:-1]) and all(0 < s <= cap for s in sizes)
    assert len(passes) == -(-sum(lens) // cap)
    # a sequence appears at most once per pass
    assert all(len({k for k, _, _ in p}) == len(p) for p in passes)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    prompts=st.lists(st.integers(1, 50), min_size=1, max_size=MAX_SLOTS),
    cap=st.integers(1, 40),
)
def test_wide_forwards_cut_into_passes_equal_one_forward(draft_model, seed, prompts, cap):
    """Sequences cut across passes of `cap` rows write the same draft KV and end in the same
    hidden states as one forward of all rows."""
    rng = np.random.default_rng(seed)
    vocab = draft_model.config.vocab_size
    whole, cut = make_drafter(draft_model), make_drafter(draft_model)
    whole.wide_pass_rows = sum(prompts)
    cut.wide_pass_rows = cap
    contexts = [rng.integers(1, vocab, n).tolist() for n in prompts]
    starts = [int(rng.integers(0, n)) for n in prompts]  # rows computed before (< n)
    before = [s for s, a in enumerate(starts) if a]
    for d in (whole, cut):
        if before:
            d._wide_rows(
                before, [0] * len(before), [contexts[s][: starts[s]] for s in before], False
            )
    slots = list(range(len(prompts)))
    rest = [c[a:] for c, a in zip(contexts, starts)]
    want = whole._wide_rows(slots, starts, rest, True)
    got = cut._wide_rows(slots, starts, rest, True)
    assert got.shape == (len(prompts), draft_model.config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for s, n in enumerate(prompts):
        torch.testing.assert_close(draft_kv(cut, s, n), draft_kv(whole, s, n))
