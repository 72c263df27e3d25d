"""The decode columns' new KV block ids, built from the round's batched allocations (AR row
blocks, then the drafts'), are exactly the tail of each request's block table: the same ids
the per-request gather from the pool's tables gives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import CostModel, ProfileCost
from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import load_cohorts
from scheduler.sim.executor import SimExecutor
from scheduler.sim.plan_bench import PROFILES

PROFILE = ProfileCost.from_file(PROFILES / "h200-qwen3-8b.json")
COHORTS = load_cohorts(PROFILES / "acceptance.json")


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    spec_depth=st.integers(2, 8),
    prompt_lens=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    spec_mode=st.sampled_from(["spec", "adaptive"]),
    seed=st.integers(0, 100),
)
def test_decode_block_ids_are_each_table_tail(block_size, spec_depth, prompt_lens, spec_mode, seed):
    cfg = SchedulerConfig(
        max_concurrency=len(prompt_lens),
        spec_mode=spec_mode,
        spec_depth=spec_depth,
        block_size=block_size,
    )
    # room for everyone's longest run, so every round takes the batched allocation path
    sched = Scheduler(cfg, len(prompt_lens) * (80 // block_size + 4), CostModel(PROFILE))
    ex = SimExecutor(PROFILE, COHORTS["code"], len(prompt_lens), seed=seed)
    for i, prompt_len in enumerate(prompt_lens):
        sched.add_request(
            RequestSpec(
                req_id=i,
                prompt_token_ids=tuple(range(10, 10 + prompt_len)),
                sampling=SamplingSpec(),
                max_tokens=40,
            )
        )
    for _ in range(30):
        if not sched.has_work():
            break
        plan = sched.plan(0.0)
        dec = plan.decode
        for i in range(len(dec)):
            q = dec.plan(i)
            assert q.new_block_ids == sched.kv.blocks_from(q.req_id, q.block_offset)
        sched.update(ex.run(plan), 0.0)
