"""Client disconnects free slots and KV; tenants: keys, 401, 429, speculation modes, metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ACME_KEY, SLOW_KEY


def _assert_idle(stats) -> None:
    assert stats.live_slots == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_usage == 0.0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_disconnect_storm_leaves_accounting_idle(server):
    """Many clients drop mid-stream (and some mid-wait on a non-streamed reply)."""
    num_streams, num_plain = 24, 6
    body = {
        "prompt": "for i in range",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": 1,
    }

    async def drop_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "n": 1 + i % 3}
        ) as response:
            num_chunks = 0
            async for _ in response.aiter_raw():
                num_chunks += 1
                if num_chunks > i % 4:
                    break  # leaving the block closes the connection mid-stream
            return response.status_code

    async def drop_while_waiting(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await client.post("/v1/completions", json=body, timeout=0.05)

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            statuses = await asyncio.gather(
                *(drop_mid_stream(client, i) for i in range(num_streams)),
                *(drop_while_waiting(client) for _ in range(num_plain)),
            )
        return [s for s in statuses if s is not None]

    statuses = asyncio.run(storm())
    assert statuses == [200] * num_streams
    _assert_idle(server.wait_idle())
    # nothing left for the engine loop to step (it must go quiet, not spin on empty rounds)
    assert server.call(lambda engine: engine.has_unfinished()) is False
    # and the server still serves
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    _assert_idle(server.wait_idle())


def _post(server, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_keys_map_to_tenants_and_unknown_keys_get_401(tenant_server):
    body = {"prompt": "x", "max_tokens": 2}
    for key in (None, "sk-wrong"):
        response = _post(tenant_server, key, body)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(tenant_server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(tenant_server.url + "/health", timeout=30).status_code == 200
    assert _post(tenant_server, ACME_KEY, body).status_code == 200


def test_tenant_speculation_modes_and_rate_limits(tenant_server):
    response = _post(tenant_server, SLOW_KEY, {"prompt": "x", "speculation": "on"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculation"
    too_big = _post(tenant_server, SLOW_KEY, {"prompt": "x", "max_tokens": 200, "n": 3})
    assert too_big.status_code == 429 and "tokens_per_minute" in too_big.text
    assert int(too_big.headers["retry-after"]) >= 1
    # requests_per_minute = 2: two pass, the third waits about 30 s
    statuses = [
        _post(tenant_server, SLOW_KEY, {"prompt": "x", "max_tokens": 2}).status_code
        for _ in range(3)
    ]
    assert statuses == [200, 200, 429]
    limited = _post(tenant_server, SLOW_KEY, {"prompt": "x", "max_tokens": 2})
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(limited.headers["retry-after"]) <= 31
    # other tenants are not limited by it
    assert _post(tenant_server, ACME_KEY, {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_per_tenant_metrics(tenant_server):
    _post(tenant_server, ACME_KEY, {"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    text = httpx.get(tenant_server.url + "/metrics", timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    acme = ("model_name", "tiny-llama"), ("tenant", "acme")
    assert samples[("hipfire:generation_tokens_total", acme)] >= 3
    assert samples[("hipfire:prompt_tokens_total", acme)] >= 1
    assert samples[("hipfire:request_success_total", (("finished_reason", "length"), *acme))] >= 1
    assert samples[("hipfire:time_to_first_token_seconds_count", acme)] >= 1
    assert not any(name.startswith("vllm:") for name, _ in samples)  # no --metrics-compat here
