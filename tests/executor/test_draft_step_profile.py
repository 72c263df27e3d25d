"""The draft-model step the profile records is the drafter's own proposal cost per chain step."""

from __future__ import annotations

import torch

from executor.profiling.drafts import time_draft_steps
from executor.random_model import random_model


def _model_counting_rows():
    """A tiny CPU model whose forwards append their row count to the returned list."""
    model = random_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    rows_seen = []
    forward = model.forward

    def counted(ids, meta, k, v):
        rows_seen.append(len(ids))
        return forward(ids, meta, k, v)

    model.forward = counted
    return model, rows_seen


def test_draft_step_times_the_drafters_proposals():
    model, calls = _model_counting_rows()
    out = time_draft_steps(model, (1, 3), repeats=2, graphs=False, chain=4)
    assert [n for n, _ in out] == [1, 3]
    assert all(ms > 0 for _, ms in out)
    # per proposal: step 0, then 3 chain steps. The first warm-up proposal catches each new
    # slot up on its 16-token context; every timed proposal (the last two of each row count)
    # is then one row per request in every step
    per_proposal = 4
    assert len(calls) == 2 * 4 * per_proposal  # two row counts x (2 warm-up + 2 timed)
    first, second = calls[:16], calls[16:]
    assert first[0] == 16 and second[0] == 1 + 16 + 16  # catch-ups of the new slots
    assert first[8:] == [1] * 8 and second[8:] == [3] * 8


def test_draft_steps_are_timed_with_the_serving_table_width():
    """The block table is padded to the serving executor's width (graphs and the attention's
    split plan follow it); the padding is never read, so proposals are those of a tight table."""
    from executor.drafters.base import DraftRequest
    from executor.profiling.drafts import standalone_drafter

    model = random_model("tiny", device=torch.device("cpu"), dtype=torch.float32)
    tight = standalone_drafter(model, 2, 40, 4, graphs=False)
    wide = standalone_drafter(model, 2, 40, 4, graphs=False, table_width=64)
    assert tight.block_tables.shape == (2, 3) and wide.block_tables.shape == (2, 64)
    assert (wide.block_tables[:, 3:] == 0).all()
    contexts = [list(range(5, 45)), list(range(100, 133))]
    outs = []
    for d in (tight, wide):
        for s in range(2):
            d.setup(s, contexts[s])
        reqs = [DraftRequest(s, contexts[s], 3) for s in range(2)]
        outs.append(d.propose(reqs, [True, True]).tokens)
    assert outs[0] == outs[1]
    assert time_draft_steps(model, (2,), repeats=1, graphs=False, chain=3, table_width=64)


def test_catch_up_of_a_whole_prompt_is_timed_as_one_forward_of_its_rows():
    from executor.profiling.drafts import time_draft_catchup

    model, rows_seen = _model_counting_rows()
    out = time_draft_catchup(model, (8, 32), repeats=2, graphs=False)
    assert [n for n, _ in out] == [8, 32] and all(ms > 0 for _, ms in out)
    # per call one forward of every context row (one draft: no chain step)
    assert rows_seen == [8] * 3 + [32] * 3
    assert time_draft_catchup(model, (), repeats=1, graphs=False) == []  # a short context


def test_catch_up_past_one_prompt_is_timed_as_several_prompts_in_one_forward():
    from executor.profiling.drafts import catchup_profile_rows, time_draft_catchup

    model, rows_seen = _model_counting_rows()
    out = time_draft_catchup(model, (8, 32), repeats=2, graphs=False, rows_per_req=8)
    assert [n for n, _ in out] == [8, 32] and all(ms > 0 for _, ms in out)
    # 32 rows: four prompts of 8 rows, caught up together in one forward per call
    assert rows_seen == [8] * 3 + [32] * 3
    # the profile's row counts: whole prompts of at most 1024 rows, up to 16 of them
    assert catchup_profile_rows(4096) == (64, 256, 512, 1024, 2048, 4096, 16384)
    assert catchup_profile_rows(600) == (64, 256, 512)
    assert catchup_profile_rows(100) == ()
