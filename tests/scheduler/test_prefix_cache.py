"""Prefix caching in the scheduler: the block pool's references and LRU eviction, hits at
admission (never a whole context, never a shared block written), admission and prefill priced
by uncached tokens only, preemption, per-tenant isolation, and a property test over random
request streams for refcounts and isolation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.kv_blocks import BlockPool
from scheduler.plan import SamplingSpec
from scheduler.prefix_cache import HOLD_MIN_TOKENS, cache_root, chain_keys
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.executor import SimExecutor
from tests.scheduler.test_lifecycle_invariants import COHORTS, PROFILE

BS = 4


def keys_of(tokens, root=b"r"):
    return chain_keys(root, tokens, BS)


# -- the block pool ----------------------------------------------------------------------------
def test_cached_blocks_are_shared_counted_and_evicted_least_recent_first():
    pool = BlockPool(num_blocks=6, block_size=BS)
    a = pool.allocate(0, 3)
    keys = keys_of(range(12))
    assert pool.register(0, 0, keys) == 3 and pool.num_cached == 3
    assert pool.lookup(keys) == list(a) and pool.lookup(keys_of(range(1, 13))) == []
    pool.share(1, pool.lookup(keys[:2]))  # a second request maps the first two
    pool.check()
    pool.free(0)  # the third loses its only reference: evictable, still counted free
    assert pool.num_free == 4 and pool.num_evictable == 1 and pool.lookup(keys) == list(a)
    pool.free(1)
    assert pool.num_free == pool.num_total and pool.num_used == 0 and pool.num_evictable == 3
    pool.check()
    # free uncached blocks go first, then the least recently released cached one: the third
    # block (released first), then request 1's tail before its head
    assert pool.allocate(2, 3) == (3, 4, 5)
    assert pool.allocate(2, 1) == (a[2],) and pool.lookup(keys) == list(a[:2])
    assert pool.allocate(2, 1) == (a[1],) and pool.lookup(keys) == [a[0]]
    pool.check()
    pool.free(2)
    assert pool.num_free == pool.num_total and pool.num_cached == 1


def test_a_key_cached_twice_keeps_its_first_block():
    pool = BlockPool(num_blocks=4, block_size=BS)
    first, second = pool.allocate(0, 1), pool.allocate(1, 1)
    key = keys_of(range(4))
    assert pool.register(0, 0, key) == 1
    assert pool.register(1, 0, key) == 0  # the same content computed twice: stays private
    pool.free(1)
    assert pool.lookup(key) == list(first) and pool.num_free == 3 and second[0] in pool._free
    pool.check()


def test_check_catches_a_reference_count_off_the_tables():
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate(0, 2)
    pool.register(0, 0, keys_of(range(8)))
    pool.share(1, pool.lookup(keys_of(range(8))))
    assert pool.truncate_to(1, 4) == 1  # a shared block dropped from one table: a reference
    pool.check()
    pool._ref[pool.blocks_of(0)[0]] += 1
    with pytest.raises(AssertionError, match="ref"):
        pool.check()


def test_keys_depend_on_position_tokens_and_scope():
    toks = list(range(8))
    assert keys_of(toks) == keys_of(toks) and len(keys_of([*toks, 9])) == 2
    assert keys_of(toks)[1] != keys_of(toks[4:] + toks[:4])[0]  # a block's key holds its prefix
    roots = {
        cache_root("a", None),
        cache_root("b", None),
        cache_root(None, None),
        cache_root("a", "s"),
        cache_root(None, "a"),
    }
    assert len(roots) == 5


# -- the scheduler -----------------------------------------------------------------------------
def make(num_blocks=64, max_concurrency=1, **cfg):
    config = SchedulerConfig(
        max_concurrency=max_concurrency,
        block_size=BS,
        spec_depth=4,
        max_prefill_tokens=cfg.pop("max_prefill_tokens", 64),
        **cfg,
    )
    sched = Scheduler(config, num_kv_blocks=num_blocks, cost_model=CostModel(PROFILE))
    return sched, SimExecutor(PROFILE, COHORTS["code"], max_concurrency, seed=0)


def spec(req_id, prompt, max_tokens=3, **kw):
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingSpec(),
        max_tokens=max_tokens,
        **kw,
    )


def run(sched, ex, *, plans=None):
    while sched.has_work():
        plan = sched.plan(0.0)
        if plans is not None:
            plans.append(plan)
        sched.update(ex.run(plan), 0.0)
        sched.kv.check()
    assert sched.kv.num_free == sched.kv.num_total and sched.kv.num_used == 0
    assert sched.kv.num_evictable == sched.kv.num_cached  # only unreferenced blocks remain


def setups(plans):
    return {s.req_id: s for p in plans for s in p.setup}


@pytest.mark.parametrize(("prompt_len", "cached"), [(21, 20), (20, 16), (3, 0)])
def test_a_repeated_prompt_starts_after_its_cached_blocks_but_computes_a_token(prompt_len, cached):
    """At most (len - 1) // block_size blocks hit: the rest, one token at least, is computed in
    a block of its own, whose first chunk is the plan's only prefill row count."""
    sched, ex = make()
    for i in range(2):
        sched.add_request(spec(i, range(prompt_len)))
    plans = []
    run(sched, ex, plans=plans)
    s = setups(plans)
    assert s[0].num_cached_tokens == 0 and s[1].num_cached_tokens == cached
    assert len(s[1].cached_block_ids) == cached // BS
    chunk = next(q for p in plans for q in p.prefills if q.req_id == 1)
    assert chunk.num_computed == cached and chunk.num_new == prompt_len - cached
    assert chunk.block_offset == cached // BS and chunk.sample
    assert sched.stats.prefix_cache_hits == {"default": cached}
    assert sched.stats.prefix_cache_queries == {"default": 2 * prompt_len}


def test_prefill_rows_and_their_price_count_only_uncached_tokens():
    """The second of two equal prompts prefills 4 rows after 1020 cached ones, priced as such
    (a round of a few prefill rows costs a launch-bound eager forward, not 1024 rows')."""
    prompt = range(1024)
    plans = {}
    for caching in (True, False):
        sched, ex = make(num_blocks=600, max_prefill_tokens=2048, enable_prefix_caching=caching)
        sched.add_request(spec(0, prompt))
        run(sched, ex)
        sched.add_request(spec(1, prompt))
        plans[caching] = sched.plan(0.0)
    assert plans[True].num_rows == 4 and plans[False].num_rows == 1024
    assert plans[True].num_kv_tokens == plans[False].num_kv_tokens == 1024
    assert plans[True].predicted_ms < plans[False].predicted_ms / 3


@pytest.mark.parametrize(("shared_len", "held"), [(HOLD_MIN_TOKENS + 8, True), (40, False)])
def test_a_prefix_in_flight_is_waited_for_not_computed_twice(shared_len, held):
    """Requests arriving together with a long common prefix: the first computes it, the others
    wait for its blocks and start from them (a prefix shorter than HOLD_MIN_TOKENS is not
    worth a round's wait: they are admitted at once). Chunks of 64 rows: the first request
    needs several rounds for its prompt."""
    common = list(range(shared_len))
    sched, ex = make(num_blocks=512, max_concurrency=3)
    for i in range(3):
        sched.add_request(spec(i, [*common, 5000 + i, 6000 + i], max_tokens=2))
    plans = []
    run(sched, ex, plans=plans)
    s = setups(plans)
    first_round = [x.req_id for x in plans[0].setup]
    cached = (shared_len // BS) * BS
    if held:
        assert first_round == [0]
        assert s[1].num_cached_tokens == s[2].num_cached_tokens == cached
        computed = sum(q.num_new for p in plans for q in p.prefills)
        assert computed == shared_len + 2 + 2 * (shared_len + 2 - cached)
    else:
        assert first_round == [0, 1, 2]
        assert s[1].num_cached_tokens == s[2].num_cached_tokens == 0


def test_admission_needs_blocks_only_for_the_uncached_rest():
    """A pool that holds one long context with little to spare admits a second request of the
    same prompt beside the first (its cached blocks are shared), not an unrelated one."""
    prompt = list(range(40))  # 10 blocks cached once computed; 12 with outputs
    for other, admitted in ((prompt, True), ([p + 1000 for p in prompt], False)):
        sched, ex = make(num_blocks=16, max_concurrency=2)
        sched.add_request(spec(0, prompt, max_tokens=8))
        sched.update(ex.run(sched.plan(0.0)), 0.0)  # its prompt is computed and cached
        sched.add_request(spec(1, other, max_tokens=8))
        plan = sched.plan(0.0)
        assert [s.req_id for s in plan.setup] == ([1] if admitted else [])
        sched.update(ex.run(plan), 0.0)
        run(sched, ex)


def test_preemption_drops_a_reference_to_shared_blocks_and_the_recompute_hits():
    """A preempted request gives back its private blocks, caching its committed full ones; the
    blocks it shares stay held by the other request: its recompute starts after them at least
    (its own cached blocks may be evicted meanwhile by the request that needed the room)."""
    from scheduler.request import ReqState

    prompt = list(range(16))
    sched, ex = make(num_blocks=9, max_concurrency=2, spec_mode="ar")
    sched.add_request(spec(0, prompt, max_tokens=19))
    sched.update(ex.run(sched.plan(0.0)), 0.0)
    sched.add_request(spec(1, [*prompt, 99, 98, 97, 96, 95], max_tokens=12))
    shared = list(sched.kv.blocks_of(0)[:4])
    plans, checked = [], False
    while sched.has_work():
        held = sched.kv.blocks_of(1)
        plan = sched.plan(0.0)
        plans.append(plan)
        if held and sched.request_state(1) == ReqState.WAITING and not checked:
            checked = True  # preempted by this plan
            assert list(held[:4]) == shared and sched.kv.blocks_of(0)[:4] == tuple(shared)
            assert all(sched.kv.key_of(b) is not None for b in held[:5])  # 16 + 4 committed
        sched.update(ex.run(plan), 0.0)
        sched.kv.check()
    assert checked and sched.stats.num_preemptions >= 1
    resumed = [s for p in plans for s in p.setup if s.req_id == 1][1:]
    assert resumed and all(s.num_cached_tokens >= len(prompt) for s in resumed)
    assert sched.stats.prefix_cache_resumed_hits > 0
    assert sched.kv.num_free == sched.kv.num_total


def test_a_finished_conversation_turn_caches_its_decoded_blocks():
    sched, ex = make()
    sched.add_request(spec(0, range(10), max_tokens=12))
    deltas = []
    while sched.has_work():
        deltas += list(sched.update(ex.run(sched.plan(0.0)), 0.0))
    turn1 = list(range(10)) + [t for d in deltas for t in d.token_ids]  # 22 tokens
    sched.add_request(spec(1, [*turn1, 7, 7, 7]))
    plans = []
    run(sched, ex, plans=plans)
    # the first 21 positions had KV (the last output's never did): 5 full blocks
    assert setups(plans)[1].num_cached_tokens == 20


@pytest.mark.parametrize(
    ("a", "b", "shared", "hit"),
    [
        (dict(tenant="x"), dict(tenant="y"), False, False),
        (dict(tenant="x"), dict(tenant="y"), True, True),
        (dict(tenant="x"), dict(tenant="x", cache_salt="s"), True, False),
        (dict(tenant="x", cache_salt="s"), dict(tenant="x", cache_salt="s"), False, True),
        (dict(tenant="x", cache_salt="s"), dict(tenant="y", cache_salt="s"), False, False),
    ],
)
def test_tenants_and_salts_isolate_unless_the_cache_is_shared(a, b, shared, hit):
    sched, ex = make(shared_prefix_cache=shared)
    sched.add_request(spec(0, range(30), **a))
    sched.add_request(spec(1, range(30), **b))
    plans = []
    run(sched, ex, plans=plans)
    assert (setups(plans)[1].num_cached_tokens > 0) == hit
    assert sum(sched.stats.prefix_cache_hits.values()) == (28 if hit else 0)


def test_caching_off_finds_nothing():
    sched, ex = make(enable_prefix_caching=False)
    for i in range(2):
        sched.add_request(spec(i, range(30)))
    plans = []
    run(sched, ex, plans=plans)
    assert all(s.num_cached_tokens == 0 for s in setups(plans).values())
    stats = sched.stats
    assert not stats.enable_prefix_caching and stats.num_cached_blocks == 0
    assert stats.prefix_cache_queries == {}


# -- random streams ----------------------------------------------------------------------------
PREFIXES = (tuple(range(100, 112)), tuple(range(200, 208)), (5,))
request_strategy = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, len(PREFIXES) - 1),
        "suffix": st.lists(st.integers(1, 3), max_size=6),
        "max_tokens": st.integers(1, 12),
        "tenant": st.sampled_from(["a", "b"]),
        "salt": st.sampled_from([None, None, "s"]),
        "arrival": st.integers(0, 12),
        "abort_round": st.none() | st.integers(0, 30),
        "speculation": st.sampled_from(["auto", "on", "off"]),
    }
)


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=9),
    shared=st.booleans(),
    max_concurrency=st.integers(1, 3),
    spare_blocks=st.integers(0, 12),
    ahead=st.booleans(),
)
def test_random_streams_keep_refcounts_and_isolation(
    requests, shared, max_concurrency, spare_blocks, ahead
):
    """Random arrivals, aborts, preemption (a small pool) and rounds run ahead: every round the
    pool's references match the tables; no round writes a cached block; every block a request
    maps from the cache was made by a request of its scope (its tenant unless the cache is
    shared, and its salt) at the same position with the same tokens; at idle the cache holds
    only unreferenced blocks."""
    run_stream(requests, shared, max_concurrency, spare_blocks, ahead)


def stream_request(tenant, salt=None, arrival=0, **kw):
    return dict(
        prefix=0, suffix=[1], max_tokens=4, tenant=tenant, salt=salt, arrival=arrival,
        abort_round=None, speculation="auto",
    ) | kw  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
def test_a_stream_shares_within_a_scope_only(shared):
    """Two tenants' equal prompts one after the other, a third with a salt: the second maps
    the first's blocks only from a shared cache, the salted one never; the last, like the
    first, always."""
    requests = [
        stream_request("a"),
        stream_request("b", arrival=1),
        stream_request("b", salt="s", arrival=2),
        stream_request("a", arrival=3, suffix=[1, 2]),
    ]
    hits = run_stream(requests, shared, 1, 20, False)
    assert hits == {1: shared, 2: False, 3: True}


def run_stream(requests, shared, max_concurrency, spare_blocks, ahead) -> dict[int, bool]:
    """Runs the stream, checking every round (see the property test); returns per request
    set up again after the first whether it started from cached blocks."""
    specs = [
        spec(
            i,
            PREFIXES[r["prefix"]] + tuple(r["suffix"]),
            max_tokens=r["max_tokens"],
            tenant=r["tenant"],
            cache_salt=r["salt"],
            speculation=r["speculation"],
        )
        for i, r in enumerate(requests)
    ]
    longest = max(len(s.prompt_token_ids) + s.max_tokens for s in specs) + 4
    sched, ex = make(
        num_blocks=-(-longest // BS) + spare_blocks,
        max_concurrency=max_concurrency,
        max_prefill_tokens=8,
        shared_prefix_cache=shared,
    )

    def scope(req_id):
        s = specs[req_id]
        return (None if shared else s.tenant, s.cache_salt)

    kv = sched.kv
    made = {}  # block -> (scope, table index, tokens) of the request that cached it
    register = kv.register

    def recording(req_id, first, keys):
        context = sched._lifecycle.requests[req_id].context_token_ids()
        table = kv.blocks_of(req_id)
        before = {b for b in table if kv.key_of(b) is not None}
        num = register(req_id, first, keys)
        for i in range(first, first + len(keys)):
            if table[i] not in before and kv.key_of(table[i]) is not None:
                made[table[i]] = (scope(req_id), i, context[i * BS : (i + 1) * BS])
        return num

    kv.register = recording
    hits: dict[int, bool] = {}
    running = None

    def run_and_update(plan):
        sched.update(ex.run(plan), 0.0)

    for round_idx in range(600):
        for i, r in enumerate(requests):
            if r["arrival"] == round_idx:
                sched.add_request(specs[i])
            if r["abort_round"] == round_idx and r["arrival"] <= round_idx:
                sched.abort(i)
        if running is not None and not sched.may_plan_ahead():
            run_and_update(running)
            running = None
        if not sched.has_work() and round_idx > max(r["arrival"] for r in requests):
            break
        plan = sched.plan(0.0)
        for s in plan.setup:
            assert s.num_cached_tokens == len(s.cached_block_ids) * BS < len(s.context_token_ids)
            hits[s.req_id] = hits.get(s.req_id, False) or s.num_cached_tokens > 0
            for i, b in enumerate(s.cached_block_ids):
                who, index, tokens = made[b]
                assert who == scope(s.req_id) and index == i
                assert tokens == s.context_token_ids[i * BS : (i + 1) * BS]
        for q in plan.reqs:  # rows are written only past every cached block of the table
            table = kv.blocks_of(q.req_id)
            assert all(kv.key_of(b) is None for b in table[q.num_computed // BS :])
        kv.check()
        if running is not None:
            run_and_update(running)
            running = None
        dec = plan.decode
        if ahead and not plan.prefills and len(dec) and not dec.num_draft.any():
            sched.advance(plan)
            running = plan
            continue
        run_and_update(plan)
    assert running is None and not sched.has_work()
    kv.check()
    assert kv.num_free == kv.num_total and kv.num_evictable == kv.num_cached
    stats = sched.stats
    for tenant, num in stats.prefix_cache_hits.items():
        assert num <= stats.prefix_cache_queries[tenant]
    return {i: hit for i, hit in hits.items() if i > 0}
