"""The profile's draft-model timings as served: a whole proposal after a verified round
(`draft_model.propose_ms`) and its growth with context (`draft_model.kv_ms_per_token`)."""

from __future__ import annotations

import pytest

from executor.profiling.drafts import time_draft_proposals
from tests.executor.test_draft_step_profile import _model_counting_rows


def test_a_proposal_after_a_verified_round_catches_up_one_or_two_rows_per_request():
    model, calls = _model_counting_rows()
    out = time_draft_proposals(model, (1, 3), (1, 3), repeats=1, graphs=False)
    assert [(k, d) for k, d, _ in out] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    assert all(ms > 0 for _, _, ms in out)
    # 3 proposals per shape (2 warm-up, 1 timed), each step 0 then d - 1 chain steps. The
    # first proposal of a new slot catches its 16-token context up; every later one starts
    # as after a verified round: 1 row for even slots, 2 for odd ones (a fully accepted chain)
    assert calls[:3] == [16, 1, 1]  # k = 1, d = 1: one forward per proposal
    assert calls[3:12] == [1, 1, 1] * 3  # k = 1, d = 3
    k3 = calls[12:]  # k = 3, d = 1 then d = 3
    assert k3[0] == 1 + 16 + 16  # slots 1 and 2 catch up
    assert k3[1:3] == [1 + 2 + 1] * 2
    assert k3[3:] == [4, 3, 3] * 3


def test_the_draft_kv_slope_is_the_proposals_growth_per_draft_and_context_token(monkeypatch):
    """With proposal times from a formula, the slope is the formula's: per draft and per token
    of context, the median over the request counts; a proposal that gets cheaper with context
    (noise) gives 0."""
    from executor.profiling import drafts

    def fake(model, counts, drafts, repeats, graphs=True, context_len=16, **_):
        return [[k, d, 2.0 + 0.5 * k + 3e-5 * k * d * context_len] for k in counts for d in drafts]

    monkeypatch.setattr(drafts, "time_draft_proposals", fake)
    fit = drafts.draft_kv_slope(None, (8, 16), 7, 1024, 2048, repeats=1)
    assert fit["kv_ms_per_token"] == pytest.approx(3e-5)
    assert [p[0] for p in fit["points"]] == [8, 16]

    def cheaper(model, counts, drafts, repeats, graphs=True, context_len=16, **_):
        return [[k, d, 10.0 - context_len * 1e-4] for k in counts for d in drafts]

    monkeypatch.setattr(drafts, "time_draft_proposals", cheaper)
    assert drafts.draft_kv_slope(None, (8,), 7, 1024, 2048, repeats=1)["kv_ms_per_token"] == 0
    # no longer context: no slope measured
    assert drafts.draft_kv_slope(None, (8,), 7, 1024, 1024, repeats=1)["points"] == []
