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
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "prefix_cache_resumed_queries": "counter",
    "prefix_cache_resumed_hits": "counter",
    "cache_config_info": "gauge",
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
        "prefix_cache_queries",
        "prefix_cache_hits",
        "cache_config_info",
    ):
        assert "vllm:" + name in families, name
    assert families["vllm:prefix_cache_queries"].type == "counter"
    assert families["vllm:cache_config_info"].type == "gauge"
    assert "vllm:prefix_cache_resumed_queries" not in families  # vLLM exports no such count
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


def _samples(server) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in _families(server).values()
        for s in f.samples
    }


def test_prefix_cache_counts_the_cached_blocks_of_a_shared_prefix(server):
    """A second prompt sharing 4 full KV blocks with a finished one finds exactly those cached."""
    block = server.engine.config.block_size
    shared = [20 + (7 * i) % 230 for i in range(4 * block)]
    url = server.url + "/v1/completions"
    body = {"max_tokens": 2, "temperature": 0}
    first = httpx.post(url, json={**body, "prompt": [*shared, 11, 12, 13, 14, 15]}, timeout=30)
    assert first.status_code == 200, first.text
    before = _samples(server)
    second_prompt = [*shared, 16, 17, 18, 19, 21, 22, 23]
    second = httpx.post(url, json={**body, "prompt": second_prompt}, timeout=30)
    assert second.status_code == 200, second.text
    after = _samples(server)

    model = (("model_name", "tiny-llama"),)
    vllm = (("engine", "0"), ("model_name", "tiny-llama"))
    for name, labels in (("hipfire:", model), ("vllm:", vllm)):
        queries = (name + "prefix_cache_queries_total", labels)
        hits = (name + "prefix_cache_hits_total", labels)
        # Every context token is looked up; the 4 shared blocks are found.
        assert after[queries] - before[queries] == len(second_prompt), name
        assert after[hits] - before[hits] == 4 * block, name
    resumed = ("hipfire:prefix_cache_resumed_queries_total", model)
    assert after[resumed] == before[resumed]  # nothing was preempted

    info = {
        "block_size": str(block),
        "num_gpu_blocks": str(server.stats().num_kv_blocks),
        "enable_prefix_caching": "True",
        "cache_dtype": "auto",
    }
    ours = ("hipfire:cache_config_info", tuple(sorted({**info, **dict(model)}.items())))
    theirs = ("vllm:cache_config_info", tuple(sorted({**info, "engine": "0"}.items())))
    assert after[ours] == 1 and after[theirs] == 1
    assert sum(1 for name, _ in after if name.endswith("cache_config_info")) == 2


def test_prefix_cache_counters_follow_the_engine_totals():
    """Per tenant only with tenant labels; a fresh engine's totals count anew; stats that are
    not `ServedStats` (those made up after an engine failure) leave the counters alone."""
    import msgspec

    from hipfire_serve.server.engine_client import ServedStats
    from hipfire_serve.server.engine_loop import RoundBatch
    from hipfire_serve.server.metrics import ServerMetrics
    from hipfire_serve.server.supervisor import idle_stats

    def stats(acme: int, slow: int, resumed: int = 0) -> ServedStats:
        common = dict(num_running=0, num_waiting=0, kv_usage=0.0, slot_capacity=4,
                      live_slots=0, num_kv_blocks=64, num_free_kv_blocks=64, block_size=16,
                      enable_prefix_caching=True)  # fmt: skip
        return ServedStats(
            **common,
            prefix_cache_queries={"acme": 2 * acme, "slow": 2 * slow},
            prefix_cache_hits={"acme": acme, "slow": slow},
            prefix_cache_resumed_queries=resumed,
            prefix_cache_resumed_hits=resumed,
        )

    # What the engine child sends crosses the pipe whole.
    batch = RoundBatch(replies=[], outputs=[], stats=stats(1, 2, 3), stats_calls=[])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=RoundBatch[ServedStats])
    assert decoded.stats == batch.stats

    per_tenant = ServerMetrics("m", tenant_labels=True)
    together = ServerMetrics("m")
    hits = "hipfire:prefix_cache_hits_total"
    assert together.registry.get_sample_value(hits, {"model_name": "m"}) == 0  # from start-up
    for snapshot in (stats(16, 32, 5), stats(48, 32, 5), idle_stats(None), stats(16, 0)):
        per_tenant.observe_engine(snapshot)
        together.observe_engine(snapshot)

    def value(metrics, name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    # 48 then (fresh engine) 16 for acme; 32 then 0 for slow.
    assert value(per_tenant, hits, tenant="acme") == 64
    assert value(per_tenant, hits, tenant="slow") == 32
    assert value(per_tenant, "hipfire:prefix_cache_queries_total", tenant="acme") == 128
    assert value(together, hits) == 96
    assert value(together, "hipfire:prefix_cache_resumed_hits_total") == 5
    assert value(per_tenant, hits) is None  # no series without the tenant label
    info = {"block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True",
            "cache_dtype": "auto"}  # fmt: skip
    assert value(together, "hipfire:cache_config_info", **info) == 1
