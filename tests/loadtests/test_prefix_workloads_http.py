"""The shared-prefix and multi-turn workloads over HTTP: against the fake OpenAI server (what
each turn sends), and one short run of each against the real server on the tiny model."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from loadtests.cli import main
from loadtests.client import ClientConfig
from loadtests.conversation import MultiTurnConfig, build_scripts
from loadtests.multi_turn import run_multi_turn
from loadtests.results import load_report
from loadtests.runners import parse_tenants
from tests.loadtests.fake_openai import FakeServer, FakeState


def _multi_turn(base_url: str, scripts, concurrency: int, think_time_s: float = 0.0):
    async def go():
        cfg = ClientConfig(base_url=base_url, model="m", endpoint="chat", max_tokens=5)
        async with httpx.AsyncClient(timeout=60) as http:
            return await run_multi_turn(
                http, cfg, scripts, concurrency, time.perf_counter, lambda r: None,
                tenants=parse_tenants([]), seed=3, think_time_s=think_time_s,
            )  # fmt: skip

    return asyncio.run(go())


def test_each_turn_sends_the_history_and_the_replies_streamed():
    scripts = build_scripts(MultiTurnConfig(3, 4, system_prompt_len=12, user_len=3), seed=0)
    state = FakeState(tokens_per_chunk=2)
    with FakeServer(state) as srv:
        records, convs = _multi_turn(srv.base_url, scripts, concurrency=2, think_time_s=0.01)
    assert len(records) == len(state.bodies) == 12 and all(r.ok for r in records)
    by_turn = {(r.extra["conversation"], r.extra["turn"]): r for r in records}
    sent = {}
    for body in state.bodies:
        users = [m for m in body["messages"] if m["role"] == "user"]
        conv = next(s for s in scripts if s.user_turns[0] == users[0]["content"])
        sent[(conv.conv_id, len(users))] = body["messages"]
    assert set(sent) == set(by_turn)
    for script in scripts:
        c = script.conv_id
        history = [{"role": "system", "content": script.system_prompt}]
        for t, user in enumerate(script.user_turns, 1):
            assert sent[(c, t)] == [*history, {"role": "user", "content": user}]
            reply = by_turn[(c, t)].output_text
            assert reply.startswith(" r") and reply.count(" ") == 5  # five tokens, this stream's
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        assert convs[c].history == history and convs[c].done
    # replies differ, so each turn carries its own conversation's earlier answers
    assert len({r.output_text for r in records}) == 12
    # at most two conversations live at once: a turn starts after its previous reply ended
    for c in range(3):
        turns = [by_turn[(c, t)] for t in range(1, 5)]
        assert all(b.submit_s >= a.end_s for a, b in itertools.pairwise(turns))


def test_a_failed_turn_ends_its_conversation():
    scripts = build_scripts(MultiTurnConfig(2, 3, system_prompt_len=4, user_len=2), seed=0)
    with FakeServer(FakeState(error_after_chunks=0)) as srv:
        records, convs = _multi_turn(srv.base_url, scripts, concurrency=2)
    assert len(records) == 2 and not any(r.ok for r in records)
    assert [c.num_done for c in convs] == [0, 0]


def test_shared_prefix_reports_hit_rate_and_first_vs_later(tmp_path):
    state = FakeState(prefix_cache=True)
    with FakeServer(state) as srv:
        rc = main([
            "shared-prefix", "--base-url", srv.base_url, "--num-groups", "2",
            "--system-prompt-len", "60", "--question-len", "4", "--num-requests", "10",
            "--concurrency", "1,3", "--max-tokens", "4", "--out", str(tmp_path),
            "--label", "sp", "--no-plots", "--no-progress",
        ])  # fmt: skip
    assert rc == 0
    report = load_report(tmp_path / "sp.json")
    assert report["workload"] == "shared-prefix" and report["shared_prefix"]["num_groups"] == 2
    first_runs = []
    for run in report["runs"]:
        assert run["num_ok"] == 10
        split = run["ttft_split"]
        assert (split["first"]["num_requests"], split["later"]["num_requests"]) == (2, 8)
        srv_delta = run["server"]
        assert srv_delta["prefix_cache_counters"] is True
        # the fake hits the 60 shared words of the 8 later requests (of 10 x 64 words sent)
        assert srv_delta["prefix_cache_hit_rate"] == pytest.approx(8 * 60 / (10 * 64))
        first_runs.append(state.bodies[len(first_runs) * 10]["prompt"])
    # every run draws its own texts: the second run finds nothing of the first in the cache
    assert first_runs[0].split()[:60] != first_runs[1].split()[:60]
    assert "ttft_first_p50_ms" in (tmp_path / "sp.csv").read_text().splitlines()[0]


def test_multi_turn_cli_without_prefix_counters_reports_them_absent(tmp_path, capsys):
    with FakeServer(FakeState()) as srv:
        rc = main([
            "multi-turn", "--base-url", srv.base_url, "--num-conversations", "2",
            "--num-turns", "3", "--system-prompt-len", "8", "--user-len", "3",
            "--concurrency", "2", "--max-tokens", "3", "--out", str(tmp_path), "--label", "mt",
            "--no-plots", "--no-progress",
        ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "absent" in out and "turn 3" in out
    run = load_report(tmp_path / "mt.json")["runs"][0]
    assert run["mode"] == "multi-turn" and run["concurrency"] == 2
    assert run["server"]["prefix_cache_counters"] is False
    assert run["server"]["prefix_cache_hit_rate"] is None
    assert list(run["turns"]) == ["1", "2", "3"]
    assert run["requests_per_s"] > 0 and run["refill_tokens_per_s"] > 0


# --- the real server on the tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.fixtures.tiny_models import make_tiny_model
    from tests.server.conftest import start_real_server

    model_dir = make_tiny_model(tmp_path_factory.mktemp("loadgen-model") / "tiny", arch="llama")
    # The tiny model's tokenizer spends about five tokens on a word: room for a few hundred.
    running = start_real_server(
        model_dir, engine_overrides={"max_model_len": 512, "kv_cache_memory": "16MiB"}
    )
    yield running
    running.stop()


def _check_server_counters(run: dict) -> None:
    server = run["server"]
    assert server is not None and server["requests_succeeded"] == run["num_ok"]
    if server["prefix_cache_counters"]:
        assert 0 < server["prefix_cache_hit_rate"] <= 1
    else:
        assert server["prefix_cache_hit_rate"] is None


def test_shared_prefix_against_the_real_server(tiny_server, tmp_path):
    rc = main([
        "shared-prefix", "--base-url", f"{tiny_server.url}/v1", "--num-groups", "2",
        "--system-prompt-len", "40", "--question-len", "3", "--num-requests", "8",
        "--concurrency", "2", "--max-tokens", "4", "--out", str(tmp_path), "--label", "sp",
        "--no-plots", "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    run = load_report(tmp_path / "sp.json")["runs"][0]
    assert run["num_ok"] == 8 and run["num_output_tokens"] == 32
    # about five tokens a word in this tokenizer: the 43 words are well over 100 tokens
    assert run["ttft_split"]["later"]["mean_prompt_tokens"] > 100
    assert run["ttft"]["p90_ms"] is not None
    _check_server_counters(run)
    assert tiny_server.wait_idle().kv_usage == 0


def test_multi_turn_against_the_real_server(tiny_server, tmp_path):
    rc = main([
        "multi-turn", "--base-url", f"{tiny_server.url}/v1", "--num-conversations", "2",
        "--num-turns", "3", "--system-prompt-len", "12", "--user-len", "3",
        "--concurrency", "2", "--max-tokens", "4", "--out", str(tmp_path), "--label", "mt",
        "--no-plots", "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    run = load_report(tmp_path / "mt.json")["runs"][0]
    assert run["num_ok"] == 6 and run["num_output_tokens"] == 24
    prompts = [run["turns"][t]["mean_prompt_tokens"] for t in ("1", "2", "3")]
    assert prompts[0] < prompts[1] < prompts[2]  # the history grows turn by turn
    _check_server_counters(run)
    assert tiny_server.wait_idle().kv_usage == 0


def test_bad_workload_arguments_exit_2(capsys):
    assert main(["shared-prefix", "--num-groups", "0", "--metrics-url", "none"]) == 2
    assert "--num-groups must be >= 1" in capsys.readouterr().err
    assert main(["multi-turn", "--think-time", "-1", "--metrics-url", "none"]) == 2
    assert "--think-time must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["multi-turn", "--endpoint", "completions"])  # conversations use the chat route
