"""The profile's speculating shapes as served: whole rounds of k speculating sequences of r rows
(`target.spec_rows_ms`), a draft model's whole proposal after a verified round
(`draft_model.propose_ms`), and speculating rounds as the engine runs them
(`target.spec_round_ratio`), read by the cost model."""

from __future__ import annotations

import pytest

from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile.build import build_profile
from hipfire_serve.engine import Engine
from scheduler.cost_model import ProfileCost
from tests.fixtures.tiny_models import make_tiny_model


def _draft_model_engine_and_profile(tmp_path):
    """A tiny target with a tiny draft model (4 slots, spec depth 4) and its profile."""
    target = make_tiny_model(tmp_path / "t", "llama")
    draft = make_tiny_model(tmp_path / "d", "llama", seed=1)
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            dtype="float32",
            max_concurrency=4,
            spec_depth=4,
            kv_cache_memory="16MiB",
            spec_mode="ar",
        )
    )
    prof = build_profile(
        engine,
        rows=(1, 2, 8),
        kv_lens=(16, 48),
        repeats=1,
        with_ceilings=False,
        host_overhead=False,
    )
    return engine, prof


def test_build_profile_measures_speculating_shapes(tmp_path):
    engine, prof = _draft_model_engine_and_profile(tmp_path)
    t = prof["target"]
    # the weights' bytes as held (a quantized model's packed layers at their size)
    assert t["weight_bytes"] == engine.target.weight_bytes
    assert prof["draft_model"]["weight_bytes"] == engine.drafter.model.weight_bytes > 0
    # k over the powers of two up to the 4 slots, r in (2, 4) within spec depth 4
    assert [(k, r) for k, r, _ in t["spec_rows_ms"]] == [(k, r) for k in (1, 2, 4) for r in (2, 4)]
    assert all(ms > 0 for _, _, ms in t["spec_rows_ms"])
    # drafts (1, 3): verify depths 2 and 4
    propose = prof["draft_model"]["propose_ms"]
    assert [(k, d) for k, d, _ in propose] == [(k, d) for k in (1, 2, 4) for d in (1, 3)]
    assert all(ms > 0 for _, _, ms in propose)
    assert ProfileCost(prof).has_spec_tables
    # proposals at twice the reference context (48 -> 96 tokens), at the 4 requests of the
    # counts profiled for it: their slope per draft and context token, never below 0
    d = prof["draft_model"]
    assert d["kv_long_context_len"] == 96
    [[k, ms_ref, ms_long]] = d["kv_points"]
    assert k == 4 and ms_ref > 0 and ms_long > 0
    slope = (ms_long - ms_ref) / (4 * 3 * (96 - 48))
    assert d["kv_ms_per_token"] == pytest.approx(max(slope, 0.0), rel=1e-3, abs=1e-12)


def test_spec_rows_take_the_same_subtraction_as_rows_ms(tmp_path, monkeypatch):
    """With round times from a formula, spec_rows_ms is the round of k groups of r rows at the
    reference context less k sequences' KV term, timed with at most 5 repeats."""
    from executor.profiling.rounds import RoundTimer

    calls = []

    def fake_time_round(self, num_rows, kv_len, repeats, rows_per_seq=None):
        calls.append((num_rows, kv_len, repeats, rows_per_seq))
        per_seq = rows_per_seq or (1 if num_rows <= 4 else -(-num_rows // 4))
        return 1.0 + 0.1 * num_rows + 0.002 * kv_len * -(-num_rows // per_seq)

    monkeypatch.setattr(RoundTimer, "time_round", fake_time_round)
    model = make_tiny_model(tmp_path / "t", "llama")
    engine = Engine(
        EngineConfig(
            model=str(model),
            draft="ngram",
            device="cpu",
            max_concurrency=4,
            spec_depth=8,
            kv_cache_memory="16MiB",
            spec_mode="ar",
        )
    )
    prof = build_profile(
        engine,
        rows=(1, 2, 4, 8),
        kv_lens=(16, 48),
        repeats=8,
        host_overhead=False,
        with_ceilings=False,
    )
    t = prof["target"]
    kv_ms_per_token = t["kv_bytes_per_token"] / (t["kv_read_TBps_assumed"] * 1e12) * 1e3
    assert kv_ms_per_token == pytest.approx(0.002, rel=1e-3)  # the formula's slope
    spec_calls = [c for c in calls if c[3] is not None]
    assert {c[2] for c in spec_calls} == {5} and {c[1] for c in spec_calls} == {48}
    assert [(k, r) for k, r, _ in t["spec_rows_ms"]] == [
        (k, r) for k in (1, 2, 4) for r in (2, 4, 8)
    ]
    for k, r, ms in t["spec_rows_ms"]:
        measured = 1.0 + 0.1 * k * r + 0.002 * 48 * k
        assert ms == pytest.approx(measured - k * 48 * kv_ms_per_token, abs=2e-4)
    # the cost model's excess of 2 groups of 4 rows: that round over the AR curve at 8 rows
    cost = ProfileCost(prof)
    spec = {(k, r): ms for k, r, ms in t["spec_rows_ms"]}
    assert cost.spec_excess_ms_scalar(2, 6) == pytest.approx(
        spec[(2, 4)] - float(cost.target_ms(8)), abs=1e-9
    )


def test_spec_round_ratio_is_the_engines_rounds_over_their_price(tmp_path):
    """The engine's full-depth speculating rounds over the profile's price: a profile that
    prices them far dearer gets a proportionally smaller factor; build_profile records it."""
    import copy

    from hipfire_serve.cost_profile.engine_steps import time_spec_round_ratio

    engine, prof = _draft_model_engine_and_profile(tmp_path)
    scheduler = engine.scheduler
    fair = time_spec_round_ratio(engine, prof, (1, 4), context_len=16, num_steps=3)
    assert engine.scheduler is scheduler and not engine.has_unfinished()
    assert [k for k, _ in fair] == [1, 4] and all(0 < r < 100 for _, r in fair)
    dear = copy.deepcopy(prof)
    t, d = dear["target"], dear["draft_model"]
    t["rows_ms"] = [[n, ms * 100] for n, ms in t["rows_ms"]]
    t["spec_rows_ms"] = [[k, r, ms * 100] for k, r, ms in t["spec_rows_ms"]]
    d["propose_ms"] = [[k, n, ms * 100] for k, n, ms in d["propose_ms"]]
    dearer = time_spec_round_ratio(engine, dear, (1, 4), context_len=16, num_steps=3)
    for (_, r_fair), (_, r_dear) in zip(fair, dearer):
        assert r_dear < r_fair / 3
    with_host = build_profile(
        engine, rows=(1, 2), kv_lens=(16,), repeats=1, with_ceilings=False, host_overhead=True
    )
    assert [k for k, _ in with_host["target"]["spec_round_ratio"]] == [1, 4]


def test_a_drafters_own_spec_terms_are_measured_with_it_in_the_engine(tmp_path):
    """`drafter_spec_terms` runs its speculating rounds with the drafter it is given (the
    engine's own drafter is not asked for a proposal), prices them with the host time it just
    measured, and puts the engine's drafter back."""
    import copy

    from executor.drafters.ngram import NgramDrafter
    from hipfire_serve.cost_profile.engine_steps import drafter_spec_terms

    engine, prof = _draft_model_engine_and_profile(tmp_path)
    own, ex = engine.drafter, engine.executor
    proposals = []
    own.propose = lambda *a, **k: proposals.append(a) or pytest.fail("the draft model drafted")
    lookup = NgramDrafter()
    lookup_propose = lookup.propose
    lookup.propose = lambda *a, **k: proposals.append(a) or lookup_propose(*a, **k)
    p = copy.deepcopy(prof)
    p.pop("draft_model")
    terms = drafter_spec_terms(engine, p, lookup)
    assert proposals  # prompt lookup drafted every speculating round
    assert engine.drafter is own and ex.drafter is own and not engine.has_unfinished()
    host = terms["spec_host_ms_per_round"]
    assert [c for c, _ in host] == [1, 4] and all(ms >= 0 for _, ms in host)
    assert [k for k, _ in terms["spec_round_ratio"]] == [1, 4]
    assert all(0 < r < 100 for _, r in terms["spec_round_ratio"])
    # a profile pricing the target's rounds a hundred times dearer gets a far smaller factor
    # (each call times its rounds and host anew: on a busy 2-core CI machine the two timings
    # have differed by 4x, so the price moves by far more than that)
    dear = copy.deepcopy(p)
    t = dear["target"]
    t["rows_ms"] = [[n, ms * 100] for n, ms in t["rows_ms"]]
    t["spec_rows_ms"] = [[k, r, ms * 100] for k, r, ms in t["spec_rows_ms"]]
    dearer = drafter_spec_terms(engine, dear, lookup)["spec_round_ratio"]
    for (_, r_fair), (_, r_dear) in zip(terms["spec_round_ratio"], dearer):
        assert r_dear < r_fair / 3


def test_ragged_profile_prompts_spread_over_half_to_one_and_a_half_times_their_mean():
    from hipfire_serve.cost_profile.engine_steps import prompt_lens

    lens = prompt_lens(8, 1024, ragged=True)
    assert lens[0] == 512 and lens[-1] == 1536 and lens == sorted(lens)
    assert abs(sum(lens) / len(lens) - 1024) < 1
    assert len(set(lens)) == 8
    assert prompt_lens(8, 1024, ragged=False) == [1024] * 8
    assert prompt_lens(1, 1024, ragged=True) == [1024]  # one request: its mean


def test_spec_round_ratio_runs_on_ragged_contexts_unless_asked_not_to(tmp_path):
    from hipfire_serve.cost_profile.engine_steps import time_spec_round_ratio

    engine, prof = _draft_model_engine_and_profile(tmp_path)
    seen = []
    add = engine.add_request
    engine.add_request = lambda req_id, prompt, params: (
        seen.append(len(prompt)) or add(req_id, prompt, params)
    )
    time_spec_round_ratio(engine, prof, (4,), context_len=16, num_steps=2)
    assert seen == [8, 13, 19, 24]  # mean 16
    seen.clear()
    time_spec_round_ratio(engine, prof, (4,), context_len=16, num_steps=2, ragged=False)
    assert seen == [16] * 4


def test_spec_round_ratio_prices_without_a_factor_the_profile_already_holds(monkeypatch):
    """The factor is the engine's rounds over the terms' price alone: measured with a profile
    that already holds one (the benchmark's equal-context comparison is), it is the same."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from hipfire_serve.cost_profile import engine_steps

    def steps(engine, c, prompt_len, num_steps, spec_mode, ragged):
        stats = SimpleNamespace(
            drafted_per_pos=[c] * 3,
            num_spec=c,
            num_prefill=0,
            num_rows=4 * c,
            num_kv_tokens=c * prompt_len,
            measured_s=0.02,
        )
        return c, [(25.0, stats)] * 3

    monkeypatch.setattr(engine_steps, "run_engine_steps", steps)
    raw = json.loads(
        (Path(__file__).parents[2] / "scheduler/profiles/h200-qwen3-8b.json").read_text()
    )
    raw["target"].pop("spec_round_ratio", None)
    alone = engine_steps.time_spec_round_ratio(None, raw, (1, 8), context_len=1024)
    raw["target"]["spec_round_ratio"] = [[1, 2.0], [8, 0.5]]
    held = engine_steps.time_spec_round_ratio(None, raw, (1, 8), context_len=1024)
    assert [k for k, _ in alone] == [1, 8] and all(r > 0 for _, r in alone)
    assert held == alone
