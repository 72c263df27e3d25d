"""`/metrics`: every name of the schema is exported, vLLM twins with --metrics-compat vllm."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

HIPFIRE_NAMES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "spec_decode_num_drafts": "counter",
    "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
    "round_rows": "histogram",
    "round_spec_requests": "histogram",
    "round_route": "counter",
    "round_duration_seconds": "histogram",
    "round_predicted_seconds": "histogram",
    "round_measured_seconds": "histogram",
    "policy_switches": "counter",
    "rounds_overlapped": "counter",
    "live_slots": "gauge",
    "slot_capacity": "gauge",
}


def _families(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_schema_names_and_vllm_twins(server):
    body = {
        "prompt": "for i in range(10):\n    print(i",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "speculation": "on",
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        r.read()
    families = _families(server)
    for name, kind in HIPFIRE_NAMES.items():
        assert families["hipfire:" + name].type == kind, name
    for name in (
        "num_requests_running",
        "kv_cache_usage_perc",
        "gpu_cache_usage_perc",
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_success",
        "generation_tokens",
        "spec_decode_num_draft_tokens",
    ):
        assert "vllm:" + name in families, name
    assert "vllm:round_rows" not in families  # the scheduler's own stay hipfire-only
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    model = (("model_name", "tiny-llama"),)
    assert values[("hipfire:slot_capacity", model)] == 8
    assert (
        values[("vllm:kv_cache_usage_perc", model)] == values[("vllm:gpu_cache_usage_perc", model)]
    )
    assert values[("hipfire:round_rows_count", model)] >= 1
    assert values[("hipfire:round_measured_seconds_count", model)] >= 1
    routes = {
        dict(labels)["route"]: v
        for (name, labels), v in values.items()
        if name == "hipfire:round_route_total"
    }
    assert set(routes) <= {"spec", "ar", "prefill"} and routes["prefill"] >= 1
    assert routes.get("spec", 0) + routes.get("ar", 0) >= 1
    drafts = values.get(("hipfire:spec_decode_num_drafts_total", model), 0)
    assert drafts == routes.get("spec", 0)
    drafted = values.get(("hipfire:spec_decode_num_draft_tokens_total", model), 0)
    accepted = values.get(("hipfire:spec_decode_num_accepted_tokens_total", model), 0)
    assert 0 <= accepted <= drafted
    # No tenant label without --metrics-tenant-labels.
    assert values[("hipfire:generation_tokens_total", model)] >= 12
    assert (
        values[("vllm:generation_tokens_total", model)]
        == values[("hipfire:generation_tokens_total", model)]
    )


def test_rounds_run_ahead_are_counted():
    from hipfire_serve.engine import RoundStats
    from hipfire_serve.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    common = dict(
        num_rows=4, num_padded_rows=4, num_kv_tokens=64, num_spec=0, num_ar=4, num_prefill=0,
        predicted_s=0.01, measured_s=0.01, phase_s={}, drafted_per_pos=[], accepted_per_pos=[],
        policy_switches=0, reason="",
    )  # fmt: skip
    for overlapped in (True, True, False):
        metrics.observe_round(RoundStats(route="AAAA", overlapped=overlapped, **common))
    value = metrics.registry.get_sample_value(
        "hipfire:rounds_overlapped_total", {"model_name": "m"}
    )
    assert value == 2
