"""Edge cases of the HTTP surface: each answered as OpenAI would, or in OpenAI's error shape.

Deep JSON, requests that can never fit the engine, explicit nulls, responses checked against the
official client's models and the OpenAPI spec's required fields, the context-length error code,
unparseable headers, tenant names on `/metrics`, query-string keys in the access log, and
metrics present from start-up.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import msgspec
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_capacity,
    decode_request,
)
from tests.server.conftest import ACME_KEY, TENANTS, RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.fixture(scope="module")
def keyed_double():
    """A server on the engine double with the tenants file, debug logging (so the access log
    is on) and no --metrics-tenant-labels."""
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.server.config import ServerConfig
    from tests.server.engine_double import EngineDouble

    names = ("uvicorn.error", "uvicorn.access", "uvicorn.asgi")
    levels = {name: logging.getLogger(name).level for name in names}
    config = ServerConfig(port=0, log_level="debug")
    running = RunningServer(EngineDouble(), EngineConfig(model="double"), config, TENANTS).start()
    yield running
    running.stop()
    for name, level in levels.items():  # debug would stay on for every later server
        logging.getLogger(name).setLevel(level)


# --- requests ---


@pytest.mark.parametrize("depth", [5_000, 50_000])  # small and large bodies (large: off the loop)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_deeply_nested_json_is_a_400(server, path, depth):
    body = b'{"messages": [], "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    error = _error(httpx.post(server.url + path, content=body, timeout=30), 400)
    assert error["type"] == "invalid_request_error" and "nested" in error["message"]


def test_request_that_can_never_be_served_is_refused_at_once(server):
    # The shared server holds 8 slots + 64 queue places: 2 prompts x 64 choices never fit.
    body = {"prompt": ["a", "b"], "n": 64, "max_tokens": 2}
    started = time.monotonic()
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    error = _error(response, 400)
    assert time.monotonic() - started < 2.0 and "retry-after" not in response.headers
    assert error["param"] == "prompt" and "128 choices" in error["message"]
    stats = server.stats()
    assert stats.live_slots == 0 and stats.num_waiting == 0
    # One prompt's choices enter the queue together: more than the queue is never servable.
    with pytest.raises(RequestError) as info:
        check_capacity(1, 20, num_slots=64, max_queue=16)
    assert info.value.param == "n" and info.value.status == 400
    check_capacity(2, 16, num_slots=16, max_queue=16)  # fits: slots + queue


def _all_null(request_type: type, keep: dict) -> dict:
    fields = msgspec.structs.fields(request_type)
    return {**{f.name: None for f in fields if f.name not in keep}, **keep}


def test_explicit_null_means_default(server):
    for request_type, keep in (
        (CompletionRequest, {"prompt": "hello"}),
        (ChatCompletionRequest, {"messages": MESSAGES}),
    ):
        body = json.dumps(_all_null(request_type, keep)).encode()
        assert decode_request(body, request_type) == decode_request(json.dumps(keep), request_type)
    options = b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": null}}'
    assert decode_request(options, CompletionRequest).stream_options.include_usage is False
    completion = httpx.post(
        server.url + COMPLETIONS, json=_all_null(CompletionRequest, {"prompt": "hello"}), timeout=30
    )
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1
    chat_body = _all_null(ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 4})
    chat = httpx.post(server.url + CHAT, json=chat_body, timeout=30)
    assert chat.status_code == 200, chat.text


# --- responses ---


def _check_spec_rules(obj: dict, chat: bool) -> None:
    """What OpenAI's OpenAPI spec requires beyond the client's models (which default every
    optional field): `system_fingerprint` is a string when present, never null; a chat
    message carries `refusal`, and chat logprobs carry `content` and `refusal`."""
    assert obj.get("system_fingerprint", "") is not None
    for choice in obj["choices"]:
        if chat and "message" in choice:
            assert {"role", "content", "refusal"} <= set(choice["message"])
        if chat and choice.get("logprobs") is not None:
            assert {"content", "refusal"} <= set(choice["logprobs"])


def test_responses_validate_against_the_openai_models(server):
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    completion = httpx.post(
        server.url + COMPLETIONS, json={**common, "prompt": "hi", "logprobs": 2}, timeout=30
    ).json()
    Completion.model_validate(completion, strict=True)
    _check_spec_rules(completion, chat=False)
    chat_body = {**common, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    chat = httpx.post(server.url + CHAT, json=chat_body, timeout=30).json()
    ChatCompletion.model_validate(chat, strict=True)
    _check_spec_rules(chat, chat=True)
    stream_body = {**chat_body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + CHAT, json=stream_body, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        ChatCompletionChunk.model_validate(chunk, strict=True)
        _check_spec_rules(chunk, chat=True)
    for card in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]:
        Model.model_validate(card, strict=True)


@pytest.mark.parametrize(
    ("path", "body"),
    [(COMPLETIONS, {"prompt": "hello"}), (CHAT, {"messages": MESSAGES})],
)
def test_context_errors_carry_context_length_exceeded(server, path, body):
    response = httpx.post(server.url + path, json={**body, "max_tokens": 1000}, timeout=30)
    assert _error(response, 400)["code"] == "context_length_exceeded"


def test_unparseable_content_length_gets_the_error_shape(server):
    for value in (b"1e20", b"-1"):
        with socket.create_connection(("127.0.0.1", server.built.server.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + value + b"\r\n\r\n{}"
            )
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "Content-Length" in error["message"]


# --- metrics and logs ---


def test_metrics_hide_tenant_names_without_the_flag(keyed_double):
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"prompt": "x", "max_tokens": 2}
    response = httpx.post(keyed_double.url + COMPLETIONS, json=body, headers=headers, timeout=30)
    assert response.status_code == 200
    text = httpx.get(keyed_double.url + "/metrics", timeout=30).text
    assert "acme" not in text and "tenant=" not in text
    counted = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert counted["hipfire:generation_tokens_total"] >= 2


def test_query_string_keys_never_reach_the_access_log(keyed_double):
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    access = logging.getLogger("uvicorn.access")
    access.addHandler(handler)
    try:
        url = keyed_double.url + "/v1/models?api_key=sk-query-secret&x"
        assert httpx.get(url, timeout=30).status_code == 401
        headers = {"Authorization": f"Bearer {ACME_KEY}"}
        assert httpx.get(url, headers=headers, timeout=30).status_code == 200
        deadline = time.monotonic() + 5
        while len(records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        access.removeHandler(handler)
    assert len(records) >= 2 and all("/v1/models?api_key=***&***" in r for r in records)
    assert not any("sk-query-secret" in r for r in records)


def test_metrics_exist_at_zero_from_start_up():
    from prometheus_client import Gauge

    from hipfire_serve.server.metrics import METRICS, PREFIX, ServerMetrics

    metrics = ServerMetrics("m", vllm_compat=True)
    model = {"model_name": "m"}
    for spec in METRICS:
        if spec.kind is Gauge:
            assert metrics.registry.get_sample_value(PREFIX + spec.name, model) == 0, spec.name
    for name in ("vllm:num_requests_running", "hipfire:spec_decode_num_drafts_total"):
        assert metrics.registry.get_sample_value(name, model) == 0, name
    assert metrics.registry.get_sample_value("hipfire:generation_tokens_total", model) == 0
