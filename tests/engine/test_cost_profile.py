"""`hipfire-serve profile` writes a profile the scheduler's cost model reads, and the engine picks
a cached profile up by its key."""

from __future__ import annotations

import json

import pytest

from hipfire_serve.cli import main as cli_main
from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile import cache
from hipfire_serve.engine import Engine
from scheduler.cost_model import CostModel, ProfileCost
from tests.fixtures.tiny_models import make_tiny_model


def test_profile_command_writes_a_profile_the_cost_model_reads(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "profile.json"
    rc = cli_main(
        [
            "profile",
            "--model",
            str(model),
            "--draft",
            "ngram",
            "--device",
            "cpu",
            "--max-concurrency",
            "4",
            "--spec-depth",
            "4",
            "--kv-cache-memory",
            "16MiB",
            "--rows",
            "1,2,8",
            "--kv-lens",
            "16,64",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    prof = json.loads(out.read_text())
    rows = [r for r, _ in prof["target"]["rows_ms"]]
    assert rows == [1, 2, 8]  # 8 rows > 4 slots: measured as speculative groups
    assert all(ms > 0 for _, ms in prof["target"]["rows_ms"])
    assert {tuple(x[:2]) for x in prof["target"]["rows_kv_ms"]} == {
        (r, k) for r in (1, 2, 8) for k in (16, 64)
    }
    assert prof["target"]["kv_read_TBps_assumed"] > 0
    # rows_ms is anchored at the profiled context nearest 1024 and carries the engine's host
    # time per round, measured at 1 and at all 4 live requests
    t = prof["target"]
    assert t["ref_kv_len"] == 64
    host = {int(c): ms for c, ms in t["host_ms_per_round"]}
    assert sorted(host) == [1, 4] and all(ms >= 0 for ms in host.values())
    kv_ms_per_token = t["kv_bytes_per_token"] / (t["kv_read_TBps_assumed"] * 1e12) * 1e3
    at_ref = {r: ms for r, k, ms in t["rows_kv_ms"] if k == 64}
    for (r, ms), seqs in zip(t["rows_ms"], (1, 2, 4)):  # 8 rows: 4 groups of 2 on 4 slots
        host_ms = host[1] + (host[4] - host[1]) * (seqs - 1) / 3
        expect = max(at_ref[r] - seqs * 64 * kv_ms_per_token, 0.1 * at_ref[r]) + host_ms
        assert abs(ms - expect) < 2e-3, (r, ms, expect)
    # rounds of prefill chunks, prompts of at most max-model-len - 1 tokens (511 here): up to
    # the budget (2048) where the 4 slots hold them (1024 rows: 3 prompts; 2048 would take 5)
    assert [r for r, _ in t["prefill_rows_ms"]] == [32, 256, 1024]
    assert all(ms > 0 for _, ms in t["prefill_rows_ms"])
    # AR rounds run ahead: their period against the round alone, per AR row count (<= slots)
    assert [r for r, _ in t["ar_ahead_ratio"]] == [1, 2]
    assert all(0 < ratio <= 1 for _, ratio in t["ar_ahead_ratio"])
    # prompt lookup has no model: its proposal time on the host, by speculating requests
    lookup = prof["drafter_host"]
    assert lookup["name"] == "ngram" and [n for n, _ in lookup["propose_ms"]] == [1, 2]
    assert all(ms > 0 for _, ms in lookup["propose_ms"])
    # speculating rounds cannot run ahead: the engine's host time around them, by requests
    spec_host = {int(c): ms for c, ms in t["spec_host_ms_per_round"]}
    assert sorted(spec_host) == [1, 4] and all(ms >= 0 for ms in spec_host.values())
    # the switch from speculating back to AR, by live requests
    restart = {int(c): ms for c, ms in t["ar_restart_ms"]}
    assert sorted(restart) == [1, 4] and all(ms >= 0 for ms in restart.values())
    cm = CostModel.from_file(out)
    assert cm.predict_ms(2, 32) > 0
    # a round of 4 requests drafting one token each: 8 rows, 4 decoding requests
    # (the engine's factor over the terms left out on both sides)
    with_host = ProfileCost(dict(prof, target={**t, "spec_round_ratio": []}))
    without = dict(prof, target={**t, "spec_host_ms_per_round": [], "spec_round_ratio": []})
    spec = with_host.round_ms_scalar(8, 0, 1, 4)
    assert spec - ProfileCost(without).round_ms_scalar(8, 0, 1, 4) == pytest.approx(spec_host[4])
    # the engine's speculating rounds over that price, by requests
    ratio = dict(t["spec_round_ratio"])
    assert sorted(ratio) == [1, 4] and all(r > 0 for r in ratio.values())
    factor = cm.profile.round_ms_scalar(8, 0, 1, 4) / spec
    # (the cost model keeps the factor within [0.5, 3]: a CPU's timings can fall outside)
    assert factor == pytest.approx(min(max(ratio[4], 0.5), 3.0))

    # the engine finds the profile in the cache by its key
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path / "cache")
    cfg = EngineConfig(
        model=str(model),
        draft="ngram",
        device="cpu",
        max_concurrency=4,
        spec_depth=4,
        kv_cache_memory="16MiB",
    )
    engine = Engine(cfg)

    def key_of(engine) -> str:
        return cache.profile_key(
            str(engine.target_dir),
            engine.draft_spec,
            engine.device,
            engine.target.dtype,
            cfg.block_size,
            cfg.max_concurrency,
        )

    key = key_of(engine)
    cached = cache.cached_profile_path(key)
    # a profile cached in an older format is not this key's
    current = cache.PROFILE_FORMAT
    monkeypatch.setattr(cache, "PROFILE_FORMAT", current - 1)
    assert key_of(engine) != key
    monkeypatch.setattr(cache, "PROFILE_FORMAT", current)
    cached.parent.mkdir(parents=True)
    cached.write_text(out.read_text())
    engine = Engine(cfg)
    assert engine.scheduler.cost_model.profile.name == prof["name"]


def test_bad_profile_path_is_a_clear_error(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    import pytest

    with pytest.raises(ValueError, match="cannot read cost profile"):
        Engine(
            EngineConfig(
                model=str(model), device="cpu", kv_cache_memory="16MiB", cost_profile=str(bad)
            )
        )


def test_build_measures_and_caches_a_profile_at_start_up(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m", "llama")
    monkeypatch.setattr(cache, "CACHE_DIR", tmp_path / "cache")
    cfg = EngineConfig(
        model=str(model),
        draft="ngram",
        device="cpu",
        max_concurrency=4,
        spec_depth=4,
        kv_cache_memory="16MiB",
        cost_profile="build",
    )
    engine = Engine(cfg)
    cached = list((tmp_path / "cache").glob("*.json"))
    assert len(cached) == 1
    prof = json.loads(cached[0].read_text())
    # rows up to slots x spec depth (16), contexts up to the model's 512 positions
    assert [r for r, _ in prof["target"]["rows_ms"]] == [1, 4, 16]
    assert engine.scheduler.cost_model.profile.name == prof["name"]
    # 'auto' on a CPU uses the cached profile now
    again = Engine(cfg.replace(cost_profile="auto"))
    assert again.scheduler.cost_model.profile.name == prof["name"]
