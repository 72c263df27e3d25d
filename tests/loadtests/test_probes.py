"""What every GPU probe shares (`loadtests/probes.py`): bad input on its command line gets one
line naming the probe and exit status 2, before any engine is built."""

from __future__ import annotations

import pytest

from loadtests import context_probe, defer_probe

BAD = [
    (context_probe, ["--rounds", "2y2"]),
    (context_probe, ["--draft-counts", "a"]),
    (context_probe, ["--context", "1"]),
    (context_probe, ["--repeats", "0"]),
    (defer_probe, ["--concurrency", "a"]),
    (defer_probe, ["--concurrency", "0"]),
    (defer_probe, ["--context", "1"]),
    (defer_probe, ["--steps", "0"]),
]


@pytest.mark.parametrize(("probe", "argv"), BAD)
def test_bad_arguments_get_one_line_and_status_2(probe, argv, tmp_path, capsys):
    assert probe.main(["--out", str(tmp_path), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    prog = probe.__name__.rsplit(".", 1)[-1]
    assert err.startswith(f"{prog}:") and "\n" not in err
