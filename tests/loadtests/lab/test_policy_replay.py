"""The engine-versus-simulator replay runs the real engine priced by a profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.lab import policy_replay

PROFILE = Path(__file__).parents[3] / "scheduler" / "profiles" / "h200-qwen3-8b.json"


def test_replay_prices_rounds_by_the_profile_and_reports_both_shares():
    out = policy_replay.replay(
        str(PROFILE), "code", 2, prompt_len=32, max_tokens=24, seeds=1, noise=0.05
    )
    assert out["num_failed"] == 0
    assert 0.0 <= out["engine_spec_share"] <= 1.0
    assert len(out["sim_spec_shares"]) == 1 and 0.0 <= out["sim_spec_shares"][0] <= 1.0
    # code-like acceptance at C = 2 on the H200 profile: both speculate
    assert out["engine_spec_share"] > 0.3 and out["sim_spec_shares"][0] > 0.3


def test_a_missing_profile_is_a_one_line_error(tmp_path, capsys):
    assert policy_replay.main(["--profile", str(tmp_path / "none.json")]) == 2
    assert "no such profile" in capsys.readouterr().err


def test_spec_share_counts_decoding_request_rounds():
    assert policy_replay.spec_share(r for r in ["SSA", "PA", "AA"]) == 2 / 6
    assert policy_replay.spec_share([]) == 0.0


def test_priced_finish_charges_speculating_rounds_the_bias():
    """A speculating round reports its price times the bias; an AR round its plain price."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from scheduler.cost_model import ProfileCost
    from scheduler.plan import Emitted, PhaseTimes, RoundResult

    profile = ProfileCost.from_file(PROFILE)
    out = Emitted.build([], [], [], [], [])
    result = RoundResult(
        round_id=0, out=out, timings=PhaseTimes(total_ms=123.0), num_rows=0, num_padded_rows=0,
        num_kv_tokens=0,
    )  # fmt: skip

    def plan(num_draft, lag=0):
        decode = SimpleNamespace(num_draft=np.array(num_draft))
        spec = int(max(num_draft)) + 1
        return SimpleNamespace(
            decode=decode, spec_depth=spec, prefills=(), num_rows=sum(num_draft) + len(num_draft),
            num_kv_tokens=4096, drafter_lag_rows=lag,
        )  # fmt: skip

    engine = SimpleNamespace(executor=SimpleNamespace(finish=lambda launched: result))
    fair = policy_replay.priced_finish(engine, profile, 0.0, random.Random(0))
    dear = policy_replay.priced_finish(engine, profile, 0.0, random.Random(0), spec_bias=1.5)
    spec, ar = SimpleNamespace(plan=plan([3, 3])), SimpleNamespace(plan=plan([0, 0]))
    assert dear(spec).timings.total_ms == 1.5 * fair(spec).timings.total_ms
    assert dear(ar).timings.total_ms == fair(ar).timings.total_ms
    assert fair(spec).timings.catchup_ms == 0.0  # no lag

    # a speculating round planned with 2,000 rows of drafter lag pays their catch-up,
    # reported as its catch-up phase, at the catch-up bias
    lagging = SimpleNamespace(plan=plan([3, 3], lag=2000))
    cu = policy_replay.priced_finish(engine, profile, 0.0, random.Random(0))
    cu_dear = policy_replay.priced_finish(engine, profile, 0.0, random.Random(0), catchup_bias=1.3)
    priced = profile.catchup_profiled_ms(2, 2000)
    assert priced > 1.0
    assert cu(lagging).timings.catchup_ms == pytest.approx(priced)
    assert cu(lagging).timings.total_ms > fair(spec).timings.total_ms + 0.5 * priced
    assert cu_dear(lagging).timings.catchup_ms == pytest.approx(1.3 * priced)
    assert cu_dear(lagging).timings.total_ms == pytest.approx(
        cu(lagging).timings.total_ms + 0.3 * priced
    )


def test_the_tiny_model_takes_a_gpu_runs_vocabulary_so_its_prompts_and_traces_match():
    """With --vocab, the replay draws the GPU benchmark's prompts (ids over the target's
    vocabulary) and so replays its acceptance traces; the tiny model embeds them."""
    from loadtests.lab.gpu.config import BenchConfig
    from loadtests.lab.gpu.runs import make_prompts

    out = policy_replay.replay(
        str(PROFILE), "code", 2, prompt_len=32, max_tokens=16, seeds=1, vocab=151936
    )
    assert out["num_failed"] == 0 and out["vocab"] == 151936
    cfg = BenchConfig(prompt_len=32, max_tokens=16, concurrency=(2,))
    assert max(max(p) for p in make_prompts(cfg, 2, 151936)) > 512  # past the preset's 512
