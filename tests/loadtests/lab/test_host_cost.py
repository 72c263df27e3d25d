"""`hipfire-bench host-cost` on the demo model: the record and its markdown, and a second run
against the first as its baseline."""

import json

from loadtests.lab import host_cost


def test_host_cost_writes_its_record_and_compares_against_a_baseline(tmp_path, capsys):
    small = ["--max-tokens", "5", "--repeats", "1", "--concurrency", "1", "--out", str(tmp_path)]
    assert host_cost.main(small) == 0
    first = json.loads((tmp_path / "cpu-host-cost.json").read_text())
    point = first["modes"]["adaptive"]["engine"]["C=1"]
    assert point["tpot_ms_median"] > 0
    assert set(point["phase_ms_per_token"]) == {*host_cost.PHASES, "other"}
    assert "| `adaptive` | 1 |" in (tmp_path / "cpu-host-cost.md").read_text()

    base = str(tmp_path / "cpu-host-cost.json")
    assert host_cost.main([*small, "--name", "again", "--baseline", base]) == 0
    md = (tmp_path / "again.md").read_text()
    again = json.loads((tmp_path / "again.json").read_text())
    ratio = again["modes"]["adaptive"]["engine"]["C=1"]["tpot_ms_median"] / point["tpot_ms_median"]
    assert f"| adaptive C=1 | {point['tpot_ms_median']:.2f} |" in md
    assert f"{ratio:.2f}x" in md
    assert "## Against the baseline" in md
    assert "| adaptive C=1 |" in capsys.readouterr().out.rsplit("| point |", 1)[1]


def test_a_baseline_that_is_not_a_record_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"modes": 3}')
    try:
        host_cost.main(["--baseline", str(bad)])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("a bad baseline was accepted")
    assert "not a host-cost record" in capsys.readouterr().err
