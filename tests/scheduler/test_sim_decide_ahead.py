"""`hipfire-serve simulate --decide-ahead` makes every next decision while the round "runs", as
the engine's loop does."""

from __future__ import annotations

from scheduler.scheduler import Scheduler
from scheduler.sim import cli
from tests.scheduler.test_lifecycle_invariants import PROFILES


def test_cli_decide_ahead_reaches_the_scheduler(monkeypatch, capsys):
    calls = []
    original = Scheduler.prepare_decision

    def counted(self):
        calls.append(self._round_id)
        return original(self)

    monkeypatch.setattr(Scheduler, "prepare_decision", counted)
    args = [
        "--profile",
        str(PROFILES / "h200-qwen3-8b.json"),
        "--acceptance",
        str(PROFILES / "acceptance.json"),
        "--cohort",
        "mixed",
        "--concurrency",
        "4",
        "--policies",
        "adaptive",
        "--requests",
        "6",
        "--max-tokens",
        "24",
        "--prompt-len",
        "16",
        "--workers",
        "1",
    ]
    assert cli.main(args) == 0
    assert calls == []  # the simulator decides inside plan() unless asked
    assert cli.main([*args, "--decide-ahead"]) == 0
    assert len(calls) > 10 and calls == sorted(calls)  # once per planned round, in order
    assert "full-live tok/s" in capsys.readouterr().out
