"""A block drafter's cost profile: its proposals by speculating requests, drafts and context and
its context write by rows (`block_drafter`), the `draft_model` section the cost model prices
from (one forward whatever the depth, no chain steps, no catch-up), the write in the target's
round curves, and the prices a speculating round gets from them."""

from __future__ import annotations

import numpy as np
import pytest

from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile.blocks import block_drafts, target_only, with_context_write
from hipfire_serve.cost_profile.build import build_profile
from hipfire_serve.engine import Engine
from scheduler.cost_model import ProfileCost


@pytest.fixture(scope="module")
def block_profile():
    engine = Engine(
        EngineConfig(
            model="random:tiny",
            draft="random-block:tiny-dflash",
            device="cpu",
            dtype="float32",
            max_concurrency=4,
            spec_depth=4,
            kv_cache_memory="16MiB",
            max_model_len=256,
            spec_mode="ar",
        )
    )
    prof = build_profile(engine, rows=(1, 2, 8), kv_lens=(16, 48), repeats=1, with_ceilings=False)
    return engine, prof


def test_the_profile_measures_the_block_drafter(block_profile):
    engine, prof = block_profile
    block = prof["block_drafter"]
    assert block["block_size"] == 8 and block["target_layer_ids"] == [0, 1]
    assert block["weight_bytes"] == engine.drafter.model.weight_bytes > 0
    assert block_drafts(4) == (1, 3)
    # proposals: k over the powers of two up to the 4 slots, the profiled contexts and twice
    # the reference one (capped by the context), drafts 1 and 3 within spec depth 4
    grid = [(k, c, d) for k, c, d, _ in block["propose_ms"]]
    assert grid == [(k, c, d) for c in (16, 48, 96) for k in (1, 2, 4) for d in (1, 3)]
    assert all(ms > 0 for *_, ms in block["propose_ms"])
    # the write at every row count of the target's curves (decode, spec groups, prefill)
    written = {n for n, _ in block["context_write_ms"]}
    t = prof["target"]
    assert {n for n, _ in t["rows_ms"]} <= written
    assert {k * r for k, r, _ in t["spec_rows_ms"]} <= written
    assert {n for n, _ in t["prefill_rows_ms"]} <= written
    assert block["context_in_target"] and block["kv_ms_per_token"] >= 0
    # the cost model's section: the proposals at the reference context, no chain step, one
    # catch-up pass longer than any context
    d = prof["draft_model"]
    assert d["kind"] == "block" and d["context_len"] == t["ref_kv_len"] == 48
    at_ref = [[k, dd, ms] for k, c, dd, ms in block["propose_ms"] if c == 48]
    assert d["propose_ms"] == at_ref
    assert all(ms == 0.0 for _, ms in d["rows_ms_per_step"])
    assert d["catchup_rows_per_pass"] > engine.max_model_len and d["max_catchup_passes"] == 1
    # the engine's speculating rounds with it, against the price of their terms
    assert [c for c, _ in t["spec_round_ratio"]] and all(r > 0 for _, r in t["spec_round_ratio"])


def test_the_block_profile_prices_drafting_without_catch_ups(block_profile):
    _, prof = block_profile
    cost = ProfileCost(prof)
    assert cost.has_spec_tables
    table = {(k, d): ms for k, d, ms in prof["draft_model"]["propose_ms"]}
    for k in (1, 2, 4):
        for d in (1, 3):
            # the proposal table, made non-decreasing in requests and drafts (noise)
            floor = max(ms for (kk, dd), ms in table.items() if kk <= k and dd <= d)
            assert cost.chain_ms_scalar(k, d) == pytest.approx(floor)
        # a lagging request (after AR rounds or its prefill) costs nothing more
        for lag in (1, 40, 200):
            assert cost.catchup_extra_ms_scalar(k, lag) == 0.0
            assert cost.round_ms_scalar(8, 400, 3, k, drafter_lag_rows=lag) == pytest.approx(
                cost.round_ms_scalar(8, 400, 3, k)
            )
    assert cost.catchup_rows_per_pass * cost.max_catchup_passes > 256  # never deferred


def _profile(propose_ms, spec_rows_ms=()):
    rows = [[n, 5.0 + 0.01 * n] for n in (1, 2, 4, 8, 16, 32, 64)]
    return {
        "target": {
            "rows_ms": rows,
            "kv_bytes_per_token": 1000,
            "kv_read_TBps_assumed": 1.0,
            "spec_rows_ms": [list(p) for p in spec_rows_ms],
        },
        "draft_model": {
            "kind": "block",
            "rows_ms_per_step": [[1, 0.0], [64, 0.0]],
            "context_len": 512,
            "propose_ms": [list(p) for p in propose_ms],
            "catchup_rows_per_pass": 10_000,
            "max_catchup_passes": 1,
        },
    }


def test_deeper_blocks_cost_only_their_verify_rows():
    """With a proposal that does not grow with depth, the planner's speculating terms of two
    prefixes differ only in the target's excess for their rows: drafting is one forward."""
    propose = [[k, d, 1.0 + 0.1 * k] for k in (1, 2, 4, 8) for d in (1, 3, 7)]
    spec = [[k, r, 5.0 + 0.012 * k * r + 0.05 * k] for k in (1, 2, 4, 8) for r in (2, 4, 8)]
    cost = ProfileCost(_profile(propose, spec))
    k = np.array([4, 4, 4])
    draft_rows = np.array([4, 12, 28])  # 4 requests at depths 2, 4, 8
    for depth in (2, 4, 8):
        terms = cost.spec_terms_ms(k, draft_rows, depth)
        drafting = terms - cost.spec_excess_ms(k, draft_rows)
        assert drafting == pytest.approx(np.full(3, 1.4))
    # the planner's form agrees with the array form
    st = cost.spec_terms(k)
    for depth in (2, 4, 8):
        got = st(np.arange(3), draft_rows, depth)
        assert got == pytest.approx(cost.spec_terms_ms(k, draft_rows, depth))
    # a whole round: the target's padded rows, KV, the excess and the one proposal
    r = cost.round_ms_scalar(32, 4 * 512 + 28, 8, 4, num_draft_rows=28)
    expected = (
        cost.padded_target_ms(32)
        + (4 * 512 + 28) * cost.kv_ms_per_token
        + 1.4
        + cost.spec_excess_ms_scalar(4, 28)
    )
    assert r == pytest.approx(float(expected))


def test_the_context_write_goes_in_and_out_of_the_target_curves():
    target = {
        "rows_ms": [[1, 5.0], [8, 6.0]],
        "spec_rows_ms": [[2, 4, 7.0]],
        "prefill_rows_ms": [[32, 20.0], [2048, 90.0]],
        "spec_round_ratio": [[1, 1.2]],
        "ref_kv_len": 512,
    }
    write = [[1, 0.1], [8, 0.2], [32, 0.5], [2048, 2.0]]
    added = with_context_write(target, write)
    assert added["rows_ms"] == [[1, 5.1], [8, 6.2]]
    assert added["spec_rows_ms"] == [[2, 4, 7.2]]  # 8 rows
    assert added["prefill_rows_ms"] == [[32, 20.5], [2048, 92.0]]
    assert added["spec_round_ratio"] == target["spec_round_ratio"]
    profile = {
        "target": added,
        "block_drafter": {"context_in_target": True, "context_write_ms": write},
        "draft_model": {"kind": "block"},
        "ceilings": {},
    }
    other = target_only(profile)
    assert set(other) == {"target", "ceilings"}
    assert other["target"]["rows_ms"] == target["rows_ms"]
    assert other["target"]["spec_rows_ms"] == target["spec_rows_ms"]
    assert other["target"]["prefill_rows_ms"] == target["prefill_rows_ms"]
    assert "spec_round_ratio" not in other["target"]


def test_without_a_profile_a_block_drafter_is_priced_as_one(block_profile, tmp_path, monkeypatch):
    """A CPU's first start has no profile: the flat default keeps a block drafter's shape (one
    forward whatever the depth, lag free), where the chain default would charge a step per draft
    and a catch-up per AR round, and the adaptive policy would never speculate with it."""
    from hipfire_serve.cost_profile import cache, resolve_cost_model
    from scheduler.cost_model import CostModel
    from scheduler.scheduler import default_profile

    engine, _ = block_profile
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path)  # nothing cached
    block = resolve_cost_model(engine)
    chain = CostModel(ProfileCost(default_profile()))

    def spec_ms(model, depth, lag=0):
        return model.raw_ms_scalar(1 + depth, 100 + depth, depth, 1, lag)

    # a deeper block costs no more than its rows (0.01 ms each); a chain pays 1 ms a step
    assert 0.0 <= spec_ms(block, 3) - spec_ms(block, 1) <= 0.03
    assert spec_ms(chain, 3) - spec_ms(chain, 1) >= 2.0
    assert spec_ms(block, 1, lag=60) == pytest.approx(spec_ms(block, 1), abs=1e-6)
    assert spec_ms(chain, 1, lag=60) > spec_ms(chain, 1)
