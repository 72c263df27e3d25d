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
