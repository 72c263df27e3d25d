from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.kv_blocks import BlockPool, KVCapacityError, num_blocks_for


def test_extend_truncate_free_round_trip():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.extend_to(1, 5) == pool.blocks_of(1)  # 2 blocks for 5 tokens
    assert pool.num_blocks_of(1) == 2
    assert pool.extend_to(1, 8) == ()  # still 2 blocks
    new = pool.extend_to(1, 9)
    assert len(new) == 1 and pool.blocks_of(1)[-1] == new[0]
    assert pool.blocks_from(1, 2) == new
    assert pool.truncate_to(1, 4) == 2
    assert pool.num_free == 7
    assert pool.free(1) == 1
    assert pool.num_free == pool.num_total == 8
    pool.check()


def test_capacity_error_changes_nothing():
    pool = BlockPool(num_blocks=3, block_size=16)
    pool.allocate(7, 2)
    with pytest.raises(KVCapacityError):
        pool.allocate(8, 2)
    assert pool.num_free == 1 and not pool.holds(8)
    pool.check()


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["extend", "truncate", "free"]), st.integers(0, 5), st.integers(0, 80)
        ),
        max_size=60,
    )
)
def test_random_operations_keep_exact_accounting(ops):
    pool = BlockPool(num_blocks=20, block_size=8)
    for op, req_id, num_tokens in ops:
        if op == "extend":
            before = pool.num_free
            try:
                new = pool.extend_to(req_id, num_tokens)
            except KVCapacityError:
                assert pool.num_free == before
                continue
            assert pool.num_blocks_of(req_id) >= num_blocks_for(num_tokens, 8)
            assert before - pool.num_free == len(new)
        elif op == "truncate":
            pool.truncate_to(req_id, num_tokens)
            assert pool.num_blocks_of(req_id) <= num_blocks_for(num_tokens, 8)
        else:
            pool.free(req_id)
            assert pool.num_blocks_of(req_id) == 0
        pool.check()
    for req_id in range(6):
        pool.free(req_id)
    assert pool.num_free == pool.num_total


@given(
    held_before=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    batch=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3)), max_size=12),
    all_ones=st.booleans(),
)
def test_allocate_many_hands_out_what_one_by_one_allocation_would(held_before, batch, all_ones):
    """The batched allocation (and its one-block-per-request fast paths) equals calling
    allocate() for each request in order: same ids, same tables."""
    if all_ones:
        batch = [(req_id, 1) for req_id, _ in batch]
    pools = [BlockPool(num_blocks=64, block_size=4) for _ in range(3)]
    for pool in pools:
        for req_id, num in enumerate(held_before):
            pool.allocate(req_id, num)
    req_ids = [req_id for req_id, _ in batch]
    counts = [num for _, num in batch]
    batched = pools[0].allocate_many(req_ids, counts)
    one_by_one = [b for req_id, num in batch for b in pools[1].allocate(req_id, num)]
    assert batched == one_by_one
    if all_ones:
        assert pools[2].allocate_one_each(req_ids) == one_by_one
    else:
        pools[2].allocate_many(req_ids, counts)
    for pool in (pools[0], pools[2]):
        assert pool.num_free == pools[1].num_free
        for req_id in range(8):
            assert pool.blocks_of(req_id) == pools[1].blocks_of(req_id)
        pool.check()


def test_one_each_allocation_past_the_free_blocks_changes_nothing():
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate(0, 2)
    with pytest.raises(KVCapacityError):
        pool.allocate_one_each([0, 1])
    assert pool.num_free == 1 and pool.blocks_of(1) == ()
    assert pool.allocate_one_each([]) == []
    pool.check()
