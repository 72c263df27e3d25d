"""Prometheus text parsing and the server-side summary of a run."""

from __future__ import annotations

import math

import pytest

from loadtests.promtext import Snapshot, parse
from loadtests.server_metrics import detect_prefix, metrics_url, summarize_delta


def test_parse_labels_escapes_and_specials():
    text = (
        "# HELP x help\n# TYPE x counter\n"
        'x_total{model_name="m",note="a \\"q\\" \\\\ b\\nc"} 3.5\n'
        "y 7 1700000000000\n"
        'h_bucket{le="+Inf"} +Inf\nz NaN\n'
    )
    samples = parse(text)
    assert samples[0].name == "x_total"
    assert samples[0].label("note") == 'a "q" \\ b\nc'
    assert samples[0].value == 3.5
    assert samples[1].value == 7
    assert math.isinf(samples[2].value) and math.isnan(samples[3].value)
    with pytest.raises(ValueError, match="line 1"):
        parse('bad{x="1" 3')


def snap(gen, drafts, draft_tokens, accepted, rows_sum, rows_n, routes, pos):
    lines = [
        f'hipfire:generation_tokens_total{{model_name="m"}} {gen}',
        'hipfire:prompt_tokens_total{model_name="m"} 100',
        f'hipfire:request_success_total{{model_name="m",finished_reason="length"}} {rows_n}',
        f"hipfire:spec_decode_num_drafts_total {drafts}",
        f"hipfire:spec_decode_num_draft_tokens_total {draft_tokens}",
        f"hipfire:spec_decode_num_accepted_tokens_total {accepted}",
        f"hipfire:round_rows_sum {rows_sum}",
        f"hipfire:round_rows_count {rows_n}",
        *(f'hipfire:round_route_total{{route="{r}"}} {v}' for r, v in routes.items()),
        *(f'hipfire:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}} {v}'
          for p, v in pos.items()),
    ]  # fmt: skip
    return Snapshot.from_text("\n".join(lines))


def test_summarize_delta():
    before = snap(1000, 10, 70, 30, 500, 20, {"spec": 5, "ar": 5, "prefill": 2}, {0: 8, 1: 6})
    after = snap(1600, 110, 770, 430, 2500, 120, {"spec": 55, "ar": 25, "prefill": 12},
                 {0: 98, 1: 76})  # fmt: skip
    assert detect_prefix(after) == "hipfire"
    d = summarize_delta(before, after)
    assert d["generation_tokens"] == 600
    assert d["requests_succeeded"] == 100
    assert d["acceptance_rate"] == pytest.approx(400 / 700)
    assert d["acceptance_length"] == pytest.approx(1 + 400 / 100)
    assert d["acceptance_per_position"] == {"0": pytest.approx(0.9), "1": pytest.approx(0.7)}
    assert d["rows_per_round"] == pytest.approx(2000 / 100)
    assert d["route_mix"] == {"ar": 0.25, "prefill": 0.125, "spec": 0.625}
    assert d["spec_requests_per_round"] is None
    assert summarize_delta(None, after) is None
    assert summarize_delta(before, Snapshot.from_text("other_metric 1")) is None


def test_metrics_url_from_api_root():
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
