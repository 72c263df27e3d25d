"""The drafter following prefill chunks, as the scheduler decides it per round
(`drafter_follows_prefill`: off, on, auto) and accounts for it: the lag it keeps for a request
agrees with the executor's whatever rounds were followed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel
from scheduler.plan import SamplingSpec
from scheduler.policy import AdaptivePolicy, AllARPolicy
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.executor import SimExecutor
from tests.scheduler.test_lifecycle_invariants import COHORTS, PROFILE


def spec(req_id: int, prompt_len: int, max_tokens: int = 6, shared: bool = False) -> RequestSpec:
    """A prompt of its own, or (`shared`) one every request's prompt starts like (the prefix
    cache then hands later requests the blocks of earlier ones)."""
    first = 3 if shared else 3 + 100 * req_id
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=tuple(range(first, first + prompt_len)),
        sampling=SamplingSpec(),
        max_tokens=max_tokens,
    )


class AskedPolicy(AdaptivePolicy):
    """Adaptive, with the follow question answered by the test."""

    def __init__(self, answer: bool):
        super().__init__()
        self.answer = answer
        self.asked = 0
        self.views = []

    def following_pays(self, view, estimator, cost_model, follow_ms, num_tokens) -> bool:
        self.asked += 1
        self.views.append((view, follow_ms, num_tokens))
        return self.answer


def scheduler(
    mode: str, policy=None, max_prefill_tokens: int = 8, spec_mode="adaptive", max_concurrency=3
):
    cfg = SchedulerConfig(
        max_concurrency=max_concurrency,
        block_size=4,
        spec_depth=4,
        spec_mode=spec_mode,
        max_prefill_tokens=max_prefill_tokens,
        drafter_follows_prefill=mode,
    )
    return Scheduler(cfg, num_kv_blocks=64, cost_model=CostModel(PROFILE), policy=policy)


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="drafter_follows_prefill"):
        scheduler("yes")


@pytest.mark.parametrize(
    ("mode", "answer", "follows"),
    [("off", True, False), ("on", False, True), ("auto", True, True), ("auto", False, False)],
)
def test_a_round_follows_its_chunks_as_the_mode_says(mode, answer, follows):
    policy = AskedPolicy(answer)
    sched = scheduler(mode, policy)
    ex = SimExecutor(PROFILE, COHORTS["code"], 3, seed=0)
    sched.add_request(spec(0, 4))
    first = sched.plan(0.0)
    # nobody decodes yet: auto asks about the live batch as it will decode
    assert first.prefills and first.follow_prefill == follows
    sched.update(ex.run(first), 0.0)
    sched.add_request(spec(1, 4))
    second = sched.plan(0.0)
    assert second.prefills and len(second.decode) == 1
    assert second.follow_prefill == follows
    assert policy.asked == (2 if mode == "auto" else 0)
    # a prompt in two chunks: the round of its second chunk keeps the answer, asks nothing
    sched.update(ex.run(second), 0.0)
    sched.add_request(spec(2, 14))
    third = sched.plan(0.0)
    policy.answer = not answer
    sched.update(ex.run(third), 0.0)
    fourth = sched.plan(0.0)
    assert [q.num_computed for q in third.prefills] == [0]
    assert [q.num_computed for q in fourth.prefills] == [8]
    assert fourth.follow_prefill == third.follow_prefill
    assert policy.asked == (3 if mode == "auto" else 0)


def test_auto_asks_about_every_live_request_as_it_will_decode():
    """The follow question's batch: the decoding requests as they are and the ones still in
    prefill with their whole prompt computed, out of dwell, drafters caught up."""
    policy = AskedPolicy(True)
    sched = scheduler("auto", policy, max_prefill_tokens=64)
    ex = SimExecutor(PROFILE, COHORTS["code"], 3, seed=0)
    sched.add_request(spec(0, 5, max_tokens=9))
    sched.update(ex.run(sched.plan(0.0)), 0.0)  # request 0 decodes from here
    sched.add_request(spec(1, 7, max_tokens=4))
    sched.add_request(spec(2, 11, max_tokens=6))
    plan = sched.plan(0.0)
    assert [q.req_id for q in plan.prefills] == [1, 2]
    view, follow_ms, num_tokens = policy.views[-1]
    # the starting prompts' cost to follow, against the tokens their requests will make
    assert follow_ms == pytest.approx(PROFILE.follow_ms(7) + PROFILE.follow_ms(11))
    assert num_tokens == 4 + 6
    assert sorted(view.req_ids.tolist()) == [0, 1, 2]
    order = np.argsort(view.req_ids)
    assert view.num_remaining[order].tolist() == [8, 4, 6]  # request 0 made its first token
    assert view.may_spec.all() and not view.drafter_lag.any() and not view.in_dwell.any()
    assert not view.was_spec.any() and view.num_prefill_rows == 0 and view.num_live == 3
    # KV: what request 0 has computed (its prompt) and the other two prompts, + a row each
    assert view.base_kv_tokens == 5 + 7 + 11 + 3
    assert view.base_rows == 3 and view.base_tokens == 3.0


def test_auto_asks_a_fixed_policy_whether_it_speculates():
    for spec_mode, policy, follows in (("spec", None, True), ("ar", AllARPolicy(), False)):
        sched = scheduler("auto", policy, spec_mode=spec_mode)
        ex = SimExecutor(PROFILE, COHORTS["code"], 3, seed=0)
        sched.add_request(spec(0, 4))
        sched.update(ex.run(sched.plan(0.0)), 0.0)
        sched.add_request(spec(1, 4))
        plan = sched.plan(0.0)
        assert plan.prefills and plan.follow_prefill == (follows and spec_mode != "ar")


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    answers=st.lists(st.booleans(), min_size=1, max_size=12),
    chunk=st.integers(1, 12),
)
@example(prompts=[1, 1, 5, 5], answers=[False, False, False, False, True], chunk=2)
def test_the_lag_kept_for_a_request_is_what_its_drafter_did_not_follow(prompts, answers, chunk):
    """Prompts in chunks over several rounds, each round followed or not: when a request
    starts decoding, the scheduler's drafter lag for it is the part of its prompt the drafter
    did not compute (a chunk counts only while it continues what was followed before), and it
    agrees with the executor's at every round; every plan carries the lag its speculating
    requests' drafters catch up in it (`drafter_lag_rows`). The prompts share their start, so
    a request may start after a cached prefix: its drafter has none of it to follow from."""
    import itertools

    rounds = itertools.cycle(answers)
    sched = scheduler("on", max_prefill_tokens=chunk)
    sched._follows_prefill = lambda prefills: next(rounds)  # the rounds' decisions, scripted
    ex = SimExecutor(PROFILE, COHORTS["code"], 3, seed=0)
    for i, n in enumerate(prompts):
        sched.add_request(spec(i, n, max_tokens=3, shared=True))
    followed: dict[int, int] = {}
    cached: dict[int, int] = {}
    for _ in range(200):
        if not sched.has_work():
            break
        plan = sched.plan(0.0)
        for s in plan.setup:
            followed[s.req_id] = 0  # (from nothing, whatever prefix the cache held)
            cached[s.req_id] = s.num_cached_tokens
        for q in plan.prefills:
            # the first chunk after a cached prefix is followed from position 0
            start = 0 if q.num_computed == cached[q.req_id] else q.num_computed
            if plan.follow_prefill and followed[q.req_id] == start:
                followed[q.req_id] = q.num_computed + q.num_new
        spec_rows = plan.decode.num_draft > 0
        assert plan.drafter_lag_rows == int(ex.slot_lag[plan.decode.slots][spec_rows].sum())
        sched.update(ex.run(plan), 0.0)
        live = np.flatnonzero(sched._slot_table.decoding)
        assert np.array_equal(sched._slot_table.drafter_lag[live], ex.slot_lag[live])
        for q in plan.prefills:
            if q.sample and q.slot in live:
                assert (
                    sched._slot_table.drafter_lag[q.slot]
                    == q.num_computed + q.num_new - followed[q.req_id]
                )
    assert not sched.has_work()


def test_auto_keeps_its_answer_for_prompts_starting_soon_after_in_a_batch_of_one_size(
    monkeypatch,
):
    """The follow question is one planner search over the live batch: prompts starting
    within FOLLOW_RECHECK_ROUNDS of it while the batch keeps its size reuse the answer."""
    from scheduler import follow_prefill as follow_module

    def run(window: int) -> tuple[int, int]:
        monkeypatch.setattr(follow_module, "FOLLOW_RECHECK_ROUNDS", window)
        policy = AskedPolicy(True)
        sched = scheduler("auto", policy, max_prefill_tokens=64)
        ex = SimExecutor(PROFILE, COHORTS["code"], 3, seed=0)
        for i in range(12):  # (finishing at different rounds: starts in a full batch too)
            sched.add_request(spec(i, 4, max_tokens=3 + i % 3))
        starts = 0
        while sched.has_work():
            plan = sched.plan(0.0)
            starts += any(q.num_computed == 0 for q in plan.prefills)
            assert plan.follow_prefill or not plan.prefills
            sched.update(ex.run(plan), 0.0)
        return policy.asked, starts

    asked, starts = run(0)
    assert asked == starts > 3  # every round where a prompt starts asks
    asked_kept, starts_kept = run(1000)
    assert starts_kept == starts and 0 < asked_kept < asked


def test_auto_keeps_its_answer_while_a_refilled_batch_stays_near_its_size(monkeypatch):
    """A batch of 16 refilled as its requests finish moves by a request or two between
    starts; within 1/FOLLOW_SIZE_TOLERANCE of the size it was asked at, the answer is kept
    (asked exactly, the refill asked again at nearly every start)."""
    from scheduler import follow_prefill as follow_module

    def asks(tolerance: int) -> int:
        monkeypatch.setattr(follow_module, "FOLLOW_SIZE_TOLERANCE", tolerance)
        policy = AskedPolicy(True)
        sched = scheduler("auto", policy, max_prefill_tokens=32, max_concurrency=16)
        ex = SimExecutor(PROFILE, COHORTS["code"], 16, seed=0)
        for i in range(64):  # (lengths vary: requests finish one or two at a time)
            sched.add_request(spec(i, 4, max_tokens=3 + i % 7))
        while sched.has_work():
            plan = sched.plan(0.0)
            assert plan.follow_prefill or not plan.prefills
            sched.update(ex.run(plan), 0.0)
        return policy.asked

    exact = asks(10**9)  # (16 // 10**9 = 0: the size must match exactly)
    assert 0 < asks(8) < exact
