"""The draft model's catch-up in passes (step 0 a few rows per request at a time, as graph
replays take it) against one forward of all rows: same proposals and same draft KV, for batches
whose requests want different numbers of drafts (down to one, or none), lag by different numbers
of AR rounds, and accept any prefix. `test_gpu_draft_graphs.py` checks the graphed passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DraftModelDrafter
from executor.model import Model
from tests.executor.test_drafters import BLOCK_SIZE, draft_kv

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_SLOTS = 4
BLOCKS_PER_SLOT = 24
MAX_MODEL_LEN = BLOCKS_PER_SLOT * BLOCK_SIZE


def make_drafter(model: Model, **kwargs) -> DraftModelDrafter:
    drafter = DraftModelDrafter(
        model,
        num_blocks=MAX_SLOTS * BLOCKS_PER_SLOT + 1,
        block_size=BLOCK_SIZE,
        max_slots=MAX_SLOTS,
        max_model_len=MAX_MODEL_LEN,
        **kwargs,
    )
    # slots own interleaved blocks, so a write through a wrong row lands in another slot's KV
    table = np.arange(MAX_SLOTS * BLOCKS_PER_SLOT, dtype=np.int32).reshape(-1, MAX_SLOTS).T
    drafter.bind_block_tables(np.ascontiguousarray(table))
    return drafter


ROUNDS = st.lists(
    st.lists(  # per slot: (AR rounds before, drafts wanted, accepted fraction)
        st.tuples(st.integers(0, 6), st.integers(0, 6), st.floats(0.0, 1.0)),
        min_size=MAX_SLOTS,
        max_size=MAX_SLOTS,
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rounds=ROUNDS)
def test_catch_up_passes_equal_one_forward_of_all_rows(draft_model, seed, rounds):
    rng = np.random.default_rng(seed)
    vocab = draft_model.config.vocab_size
    reference = make_drafter(draft_model)
    passes = make_drafter(draft_model, catchup_rows_per_pass=2)
    assert reference.catchup_rows_per_pass is None  # no graphs on a CPU: one forward
    drafters = (reference, passes)
    contexts = {s: rng.integers(1, vocab, int(rng.integers(1, 12))).tolist() for s in range(4)}
    for d in drafters:
        for s, ctx in contexts.items():
            d.setup(s, ctx)
    for per_slot in rounds:
        for s, (num_ar, _, _) in enumerate(per_slot):
            for _ in range(num_ar):  # AR rounds: the drafter falls behind by one token each
                contexts[s].append(int(rng.integers(1, vocab)))
                for d in drafters:
                    d.commit(s, contexts[s], 0, 0)
        reqs = [
            DraftRequest(s, list(contexts[s]), nd)
            for s, (_, nd, _) in enumerate(per_slot)
            if len(contexts[s]) + nd < MAX_MODEL_LEN - 1
        ]
        if not reqs:
            continue
        want = reference.propose(reqs, [True] * len(reqs))
        got = passes.propose(reqs, [True] * len(reqs))
        assert got.tokens == want.tokens
        assert got.extra.get("num_catchup_rows") == want.extra.get("num_catchup_rows")
        for r, drafts in zip(reqs, want.tokens):
            num_accepted = int(per_slot[r.slot][2] * len(drafts))
            contexts[r.slot] += [*drafts[:num_accepted], int(rng.integers(1, vocab))]
            for d in drafters:
                d.commit(r.slot, contexts[r.slot], num_accepted, r.num_draft)
    assert np.array_equal(reference.kv_len, passes.kv_len)
    for s in range(MAX_SLOTS):
        n = int(reference.kv_len[s])
        torch.testing.assert_close(draft_kv(passes, s, n), draft_kv(reference, s, n))


def test_sampled_first_drafts_keep_their_distribution_through_passes(draft_model):
    """Requests leave the passes at different ones: each one's first draft distribution (the
    softmax of its last context row, no sampling before it) lands in its own probs row."""
    rng = np.random.default_rng(5)
    vocab = draft_model.config.vocab_size
    contexts = [rng.integers(1, vocab, n).tolist() for n in (3, 11, 7)]
    reqs = [DraftRequest(s, contexts[s], d, temperature=0.8) for s, d in enumerate((2, 3, 1))]
    out = {}
    for name, per_pass in (("one", None), ("passes", 2)):
        drafter = make_drafter(draft_model, catchup_rows_per_pass=per_pass, seed=9)
        for s, ctx in enumerate(contexts):
            drafter.setup(s, ctx)
        out[name] = drafter.propose(reqs, [False, True, False])
    first_rows = [0, 2, 5]  # request offsets in probs: 2 + 3 + 1 drafts
    one, passes = out["one"].probs, out["passes"].probs
    torch.testing.assert_close(passes[first_rows], one[first_rows])
    assert passes[2].max() == 1.0  # the greedy request's point mass
    assert out["passes"].tokens[1][0] == out["one"].tokens[1][0]
