"""`hipfire-bench quant-agreement` on the demo target: its incremental greedy decode against
the full-recompute reference, the record of a small call with a sane agreement floor, and the
one-line refusals."""

from __future__ import annotations

import json

import pytest

from executor.loader import load_model
from hipfire_serve.demo import demo_model_dir
from loadtests.lab.quant_agreement import greedy, main
from tests.quant.forward import greedy as greedy_reference


def test_incremental_greedy_matches_full_recompute():
    model = load_model(demo_model_dir(), dtype="float32")
    prompt = [5, 17, 42, 99, 3, 250, 11, 7, 64, 128, 33, 2, 300, 301, 302, 303, 304]  # > a block
    assert greedy(model, prompt, 6) == greedy_reference(model, prompt, 6)


def test_small_call_writes_the_record(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--prompts", "2", "--tokens", "6"]) == 0
    rec = json.loads((tmp_path / "quant-agreement.json").read_text())
    assert rec["model"] == "the demo target" and rec["prompts"] == 2 and rec["tokens"] == 6
    assert [len(t) for t in rec["bf16_tokens"]] == [6, 6]
    for name in ("fp8", "w4a16"):
        f = rec["formats"][name]
        assert [len(t) for t in f["tokens"]] == [6, 6]
        assert 0.0 <= f["agreement"]["position_match"] <= 1.0
    # FP8 weights keep the demo target's first greedy token (95% of 20 prompts measured)
    assert rec["formats"]["fp8"]["first_token_match"] >= 0.5
    assert "| fp8 |" in (tmp_path / "quant-agreement.md").read_text()


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's refusals
        return int(e.code)


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--prompts", "0"], "--prompts"), (["--cohort", "nowhere.jsonl"], "--cohort"),
     (["--model", "."], "--model"), (["--prompts", "500"], "--prompts")],
)  # fmt: skip
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, flag):
    assert _exit_code(["--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hipfire-bench quant-agreement") and flag in err
    assert not list(tmp_path.iterdir())
