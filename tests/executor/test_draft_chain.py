"""The draft model's fused greedy chain and its catch-up passes against step-by-step drafting:
same proposals and same draft KV, for batches whose requests want different numbers of drafts
(down to one, or none), lag by different numbers of AR rounds, and accept any prefix. On a CPU
the fused chain runs its graph body eagerly from the same static buffers, so the row placement
of requests that sit steps out is what is checked here; `test_gpu_draft_graphs.py` replays it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DraftModelDrafter
from executor.loader import load_model
from executor.model import Model
from tests.fixtures.tiny_models import make_tiny_model

BLOCK_SIZE = 4
MAX_SLOTS = 4
BLOCKS_PER_SLOT = 24
MAX_MODEL_LEN = BLOCKS_PER_SLOT * BLOCK_SIZE


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> Model:
    return load_model(make_tiny_model(tmp_path_factory.mktemp("chain"), "qwen3", seed=2))


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


def slot_kv(drafter: DraftModelDrafter, slot: int, num_positions: int) -> torch.Tensor:
    """K and V of the slot's first positions: [layers, 2, positions, heads, dim]."""
    pos = np.arange(num_positions)
    blocks = torch.from_numpy(drafter.block_tables[slot, pos // BLOCK_SIZE].astype(np.int64))
    offsets = torch.from_numpy(pos % BLOCK_SIZE)
    return torch.stack(
        [
            torch.stack([k[blocks, offsets], v[blocks, offsets]])
            for k, v in zip(drafter.kv.k, drafter.kv.v)
        ]
    )


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
def test_fused_chain_and_catch_up_passes_equal_step_by_step_drafting(draft_model, seed, rounds):
    rng = np.random.default_rng(seed)
    vocab = draft_model.config.vocab_size
    reference = make_drafter(draft_model, chain="steps")
    fused = make_drafter(draft_model, chain="fused", catchup_rows_per_pass=2)
    assert fused.chain is not None and reference.chain is None
    drafters = (reference, fused)
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
        got = fused.propose(reqs, [True] * len(reqs))
        assert got.tokens == want.tokens
        assert got.extra.get("num_catchup_rows") == want.extra.get("num_catchup_rows")
        for r, drafts in zip(reqs, want.tokens):
            num_accepted = int(per_slot[r.slot][2] * len(drafts))
            contexts[r.slot] += [*drafts[:num_accepted], int(rng.integers(1, vocab))]
            for d in drafters:
                d.commit(r.slot, contexts[r.slot], num_accepted, r.num_draft)
    assert np.array_equal(reference.kv_len, fused.kv_len)
    for s in range(MAX_SLOTS):
        n = int(reference.kv_len[s])
        torch.testing.assert_close(slot_kv(fused, s, n), slot_kv(reference, s, n))


def test_a_request_that_sits_steps_out_writes_no_kv_past_its_drafts(draft_model):
    """In a fused chain a one-draft request idles for the other's steps: its KV stays exactly
    as long as its own drafts need, and its neighbour's blocks are untouched by it."""
    fused = make_drafter(draft_model, chain="fused")
    before = [k.clone() for k in fused.kv.k]
    ctx0, ctx1 = [5, 6, 7], [9, 10, 11, 12, 13]
    fused.setup(0, ctx0)
    fused.setup(1, ctx1)
    out = fused.propose([DraftRequest(0, ctx0, 1), DraftRequest(1, ctx1, 6)], [True, True])
    assert [len(t) for t in out.tokens] == [1, 6]
    written = set()
    for k_new, k_old in zip(fused.kv.k, before):
        changed = (k_new != k_old).flatten(2).any(-1).nonzero().tolist()  # [block, offset]
        written |= {b * BLOCK_SIZE + o for b, o in changed}
    table = fused.block_tables
    slot_positions = {
        s: {int(table[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)}
        for s, n in ((0, len(ctx0)), (1, len(ctx1) + 5))
    }
    # slot 0: its context only (the single draft is never fed); slot 1: context + 5 drafts
    assert written == slot_positions[0] | slot_positions[1]


def test_chain_modes_are_checked(draft_model):
    with pytest.raises(ValueError, match="chain must be"):
        make_drafter(draft_model, chain="graph")
