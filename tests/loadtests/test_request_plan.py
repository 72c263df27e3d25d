"""Request planning, arrival times, token spreading and the progress line."""

from __future__ import annotations

import io
import itertools
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.client import ClientConfig, PlannedRequest, request_body, spread_tokens
from loadtests.progress import Progress
from loadtests.prompts import load_cohort, seeded_order
from loadtests.records import RequestRecord
from loadtests.runners import arrival_times, parse_tenants, plan_requests


@given(st.integers(0, 500), st.lists(st.integers(0, 300), max_size=30))
def test_spread_tokens_conserves_the_total(total, weights):
    counts = spread_tokens(total, weights)
    assert len(counts) == len(weights)
    if weights:
        assert sum(counts) == total
        if total >= len(weights):
            assert min(counts) >= 1


def test_spread_tokens_follows_text_length():
    assert spread_tokens(10, [1, 1, 8]) == [1, 1, 8]
    assert spread_tokens(2, [5, 5, 5]) == [1, 1, 0]


def test_plan_is_seeded_and_takes_tenants_in_turn():
    prompts = load_cohort("prose")
    tenants = parse_tenants(["alice=k1", "k2"])
    assert [t.name for t in tenants] == ["alice", "tenant1"]
    plan = plan_requests(prompts, 2 * len(prompts) + 3, tenants, seed=7)
    assert plan == plan_requests(prompts, 2 * len(prompts) + 3, tenants, seed=7)
    assert plan != plan_requests(prompts, 2 * len(prompts) + 3, tenants, seed=8)
    # Every prompt is used once per pass over the cohort.
    assert {r.prompt_id for r in plan[: len(prompts)]} == {p.prompt_id for p in prompts}
    assert [r.api_key for r in plan[:4]] == ["k1", "k2", "k1", "k2"]
    assert [r.seed for r in plan[:3]] == [7, 8, 9]
    # A shorter run uses a prefix of a longer one: runs at different C share prompts.
    assert seeded_order(prompts, 5, 3) == seeded_order(prompts, 50, 3)[:5]
    with pytest.raises(ValueError):
        parse_tenants(["a=k1", "a=k2"])


def test_arrival_times_mean_rate_and_burstiness():
    regular = arrival_times(2000, rate=10.0, burstiness=50.0, seed=1)
    bursty = arrival_times(2000, rate=10.0, burstiness=0.2, seed=1)
    for times in (regular, bursty):
        assert times[0] == 0.0
        assert times == sorted(times)
        assert times[-1] / (len(times) - 1) == pytest.approx(0.1, rel=0.15)
    gaps = [statistics.pstdev(b - a for a, b in itertools.pairwise(t)) for t in (regular, bursty)]
    assert gaps[0] < 0.03 < gaps[1]  # the gamma shape sets the spread of the gaps
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, 0)


def test_request_body_for_both_endpoints():
    req = PlannedRequest(req_id=0, prompt_id="p", prompt="hi", seed=3)
    cfg = ClientConfig(base_url="http://x/v1", model="m", max_tokens=5, extra_body={"top_k": 2})
    body = request_body(cfg, req)
    assert body["prompt"] == "hi" and body["ignore_eos"] and body["top_k"] == 2
    assert body["stream_options"] == {"include_usage": True} and body["seed"] == 3
    chat = request_body(ClientConfig(base_url="u", model="m", endpoint="chat",
                                     ignore_eos=False), req)  # fmt: skip
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in chat and "prompt" not in chat


def test_progress_line():
    stream = io.StringIO()
    bar = Progress(total=4, title="C=2", enabled=True, stream=stream)
    ok = RequestRecord(req_id=0, tenant="t", submit_s=0, end_s=1, chunk_times_s=(0.5,),
                       chunk_tokens=(10,), num_output_tokens=10)  # fmt: skip
    bar.update(ok)
    bar.update(RequestRecord(req_id=1, tenant="t", submit_s=0, end_s=1, error="boom"))
    line = bar.line(elapsed_s=2.0, width=8)
    assert line == "C=2 [####....] 2/4 req 10 tok 5 tok/s 2.0s 1 err"
    bar.close()
    assert stream.getvalue().startswith("\rC=2 [") and stream.getvalue().endswith("\n")
