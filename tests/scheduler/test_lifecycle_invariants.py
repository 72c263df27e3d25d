"""Accounting invariants of the scheduler under random workloads, run against the simulator's
executor (random acceptance, deterministic 'greedy' tokens)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.kv_blocks import num_blocks_for
from scheduler.plan import Mode, SamplingSpec
from scheduler.request import ReqState, RequestSpec
from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.executor import SimExecutor, default_token
from scheduler.tenants import TenantSpec

PROFILES = Path(__file__).resolve().parents[2] / "scheduler" / "profiles"
PROFILE = ProfileCost.from_file(PROFILES / "h200-qwen3-8b.json")
COHORTS = load_cohorts(PROFILES / "acceptance.json")
EOS, STOP_TOKEN = 1, 2
BLOCK_SIZE = 4


def expected_output(req_id, max_tokens, min_tokens, eos_at, stop_tok_at, stop_str_at, token):
    """What the request must emit: the greedy token stream cut at the first stop."""
    out = []
    for i in range(max_tokens):
        tok = token(req_id, i)
        out.append(tok)
        if len(out) > min_tokens and tok in (EOS, STOP_TOKEN):
            return out, "stop"
        if stop_str_at is not None and i == stop_str_at:
            return out, "stop"
    return out, "length"


request_strategy = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 30),
        "max_tokens": st.integers(1, 24),
        "min_tokens": st.integers(0, 3),
        "eos_at": st.none() | st.integers(0, 20),
        "stop_tok_at": st.none() | st.integers(0, 20),
        "stop_str_at": st.none() | st.integers(0, 20),
        "speculation": st.sampled_from(["auto", "auto", "on", "off"]),
        "tenant": st.sampled_from(["a", "b", "c"]),
        "abort_round": st.none() | st.integers(0, 40),
    }
)


@settings(max_examples=60)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=10),
    max_concurrency=st.integers(1, 5),
    spec_mode=st.sampled_from(["adaptive", "spec", "ar"]),
    has_drafter=st.booleans(),
    spare_blocks=st.integers(0, 30),
    cohort=st.sampled_from(["code", "prose", "mixed"]),
    seed=st.integers(0, 1000),
    tenant_cap=st.integers(0, 2),
    ahead=st.booleans(),
)
def test_random_workload_accounting(
    requests, max_concurrency, spec_mode, has_drafter, spare_blocks, cohort, seed, tenant_cap, ahead
):
    """With `ahead`, the loop runs as the engine's with overlapped rounds: an AR-only decode
    round is advanced and the next round planned before its update."""
    spec_depth = 4
    # KV: the largest request (plus its deepest chain) always fits alone, little more, so
    # preemption happens often.
    longest = max(r["prompt_len"] + r["max_tokens"] for r in requests) + spec_depth
    num_blocks = num_blocks_for(longest, BLOCK_SIZE) + spare_blocks
    cfg = SchedulerConfig(
        max_concurrency=max_concurrency,
        spec_mode=spec_mode,
        spec_depth=spec_depth,
        block_size=BLOCK_SIZE,
        max_prefill_tokens=8,
        has_drafter=has_drafter,
    )
    eos_at = {i: r["eos_at"] for i, r in enumerate(requests)}
    stop_tok_at = {i: r["stop_tok_at"] for i, r in enumerate(requests)}

    def token(req_id, index):
        if eos_at[req_id] == index:
            return EOS
        if stop_tok_at[req_id] == index:
            return STOP_TOKEN
        return default_token(req_id, index)

    seen = defaultdict(int)

    def stop_checker(req_id, new_tokens):
        at = requests[req_id]["stop_str_at"]
        before = seen[req_id]
        seen[req_id] += len(new_tokens)
        if at is not None and before <= at < before + len(new_tokens):
            seen[req_id] = at + 1
            return at - before + 1, "STOP"
        return None

    tenants = [TenantSpec("a", 1.0, tenant_cap), TenantSpec("b", 2.0), TenantSpec("c", 1.0, 1)]
    sched = Scheduler(cfg, num_blocks, CostModel(PROFILE), tenants, stop_checker)
    ex = SimExecutor(PROFILE, COHORTS[cohort], max_concurrency, seed=seed, token_fn=token)
    for i, r in enumerate(requests):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=tuple(range(10, 10 + r["prompt_len"])),
                sampling=SamplingSpec(),
                max_tokens=r["max_tokens"],
                min_tokens=min(r["min_tokens"], r["max_tokens"]),
                eos_token_ids=(EOS,),
                stop_token_ids=(STOP_TOKEN,),
                tenant=r["tenant"],
                speculation=r["speculation"],
            )
        )
    streamed = defaultdict(list)
    finish = {}
    now = 0.0

    def run_and_update(plan):
        nonlocal now
        result = ex.run(plan)
        now += result.timings.total_ms / 1e3
        for delta in sched.update(result, now):
            assert delta.req_id not in finish or finish[delta.req_id] == "abort"
            if finish.get(delta.req_id) == "abort":
                continue
            streamed[delta.req_id].extend(delta.token_ids)
            if delta.finish_reason:
                finish[delta.req_id] = delta.finish_reason

    running = None  # the advanced round, run and updated after the next plan
    for round_idx in range(2000):
        for i, r in enumerate(requests):
            if r["abort_round"] == round_idx and i not in finish:
                sched.abort(i)
                finish[i] = "abort"
        if running is not None and not sched.may_plan_ahead():
            run_and_update(running)
            running = None
        if not sched.has_work():
            assert running is None
            break
        behind = running is not None
        plan = sched.plan(now)
        slots = [q.slot for q in plan.reqs]
        assert len(slots) == len(set(slots)) and all(0 <= s < max_concurrency for s in slots)
        assert sched.num_running <= max_concurrency
        per_tenant = defaultdict(int)
        for req in sched._lifecycle.live:
            per_tenant[req.spec.tenant] += 1
        assert tenant_cap == 0 or per_tenant["a"] <= tenant_cap
        assert per_tenant["c"] <= 1
        assert plan.num_rows == sum(q.num_new for q in plan.reqs)
        for q in plan.reqs:
            held = sched.kv.num_blocks_of(q.req_id)
            assert held * BLOCK_SIZE >= q.num_computed + q.num_new  # every written row has KV
            assert q.block_offset + len(q.new_block_ids) == held
            # the plan's ids (from the round's batched allocations) are the table's tail
            assert q.new_block_ids == sched.kv.blocks_from(q.req_id, q.block_offset)
            if q.mode == Mode.SPEC:
                assert has_drafter and spec_mode != "ar"
                assert 1 <= q.num_draft <= spec_depth - 1
                assert requests[q.req_id]["speculation"] != "off"
            if behind:
                assert q.mode != Mode.SPEC  # its last token is not known yet
            elif spec_mode == "spec" and q.mode == Mode.AR and has_drafter:
                # full depth unless the request opts out, is one token from max_tokens, or a
                # draft's KV block did not fit (then the pool is empty after the plan)
                r = requests[q.req_id]
                emitted = len(streamed[q.req_id])
                draft_needs_block = num_blocks_for(q.num_computed + 2, BLOCK_SIZE) > held
                assert (
                    r["speculation"] == "off"
                    or r["max_tokens"] - emitted <= 1
                    or (draft_needs_block and sched.kv.num_free == 0)
                )
        sched.kv.check()
        if running is not None:
            run_and_update(running)
            running = None
        if not (plan.num_reqs or plan.setup or plan.release):
            continue
        decode = plan.decode
        if ahead and not plan.prefills and len(decode) and not decode.num_draft.any():
            sched.advance(plan)
            sched.prepare_decision()
            running = plan
            continue
        run_and_update(plan)
    else:
        pytest.fail("workload did not finish")
    assert running is None

    # idle again: every slot and block returned
    assert sched.kv.num_free == num_blocks and sched.num_free_slots == max_concurrency
    assert sched.num_running == 0 and sched.num_waiting == 0
    for i, r in enumerate(requests):
        want, reason = expected_output(
            i,
            r["max_tokens"],
            min(r["min_tokens"], r["max_tokens"]),
            eos_at[i],
            stop_tok_at[i],
            r["stop_str_at"],
            token,
        )
        assert i in finish
        if finish[i] == "abort":
            assert streamed[i] == want[: len(streamed[i])]
        else:
            assert streamed[i] == want, f"request {i}"
            assert finish[i] == reason


def test_queue_full_and_too_long():
    cfg = SchedulerConfig(max_concurrency=1, max_queue=1, block_size=4, max_model_len=64)
    sched = Scheduler(cfg, num_kv_blocks=8)

    def spec(req_id, prompt_len=4, max_tokens=4):
        return RequestSpec(
            req_id=req_id,
            prompt_token_ids=tuple(range(prompt_len)),
            sampling=SamplingSpec(),
            max_tokens=max_tokens,
        )

    with pytest.raises(ValueError, match="context length"):
        sched.add_request(spec(0, 60, 8))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(spec(0, 30, 8))  # 38 tokens > 8 blocks * 4
    sched.add_request(spec(1))
    with pytest.raises(QueueFullError):
        sched.add_request(spec(2))
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request(spec(1))
    sched.abort(1)
    assert sched.request_state(1) is None and not sched.has_work()
    sched.add_request(spec(2))
    assert sched.request_state(2) == ReqState.WAITING


def test_abort_while_decoding_frees_in_next_plan():
    cfg = SchedulerConfig(max_concurrency=2, block_size=4, spec_depth=4)
    sched = Scheduler(cfg, num_kv_blocks=16, cost_model=CostModel(PROFILE))
    ex = SimExecutor(PROFILE, COHORTS["code"], 2, seed=0)
    for i in range(2):
        sched.add_request(
            RequestSpec(
                req_id=i, prompt_token_ids=(5, 6, 7), sampling=SamplingSpec(), max_tokens=50
            )
        )
    for _ in range(3):
        sched.update(ex.run(sched.plan(0.0)), 0.0)
    assert sched.request_state(0) == ReqState.DECODING
    slot0 = next(r.slot for r in sched._lifecycle.live if r.req_id == 0)
    sched.abort(0)
    plan = sched.plan(0.0)
    assert plan.release == (slot0,)
    assert [q.req_id for q in plan.reqs] == [1]
    assert not sched.kv.holds(0)


@pytest.mark.parametrize(
    "prompts,chunks",
    [
        ((70,), [[70]]),  # a rest of 6 <= 64 / 8 goes with the chunk: one round
        ((73,), [[64], [9]]),  # a rest of 9 does not
        ((40, 30), [[40, 30]]),  # the second prompt's rest (6) goes along: 70 rows in a round
        ((40, 40), [[40, 24], [16]]),
    ],
)
def test_a_short_rest_of_a_prompt_goes_with_its_chunk(prompts, chunks):
    """A prompt's rest of at most an eighth of the prefill budget is taken in the same round,
    not left to an eager round of its own; no round takes more than max_chunk_rows rows."""
    from scheduler.scheduler import max_chunk_rows

    cfg = SchedulerConfig(max_concurrency=4, block_size=BLOCK_SIZE, max_prefill_tokens=64)
    sched = Scheduler(cfg, num_kv_blocks=256, cost_model=CostModel(PROFILE))
    for i, n in enumerate(prompts):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=tuple(range(1, n + 1)),
                sampling=SamplingSpec(),
                max_tokens=3,
            )
        )
    ex = SimExecutor(PROFILE, COHORTS["code"], 4, seed=0, noise_sigma=0.0)
    seen = []
    while sched.has_work():
        plan = sched.plan(0.0)
        if plan.prefills:
            seen.append([r.num_new for r in plan.prefills])
            assert sum(seen[-1]) <= max_chunk_rows(64)
        sched.update(ex.run(plan), 0.0)
    assert seen == chunks
