"""The engine-versus-simulator replay runs the real engine priced by a profile."""

from __future__ import annotations

from pathlib import Path

from loadtests import policy_replay

PROFILE = Path(__file__).parents[2] / "scheduler" / "profiles" / "h200-qwen3-8b.json"


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
