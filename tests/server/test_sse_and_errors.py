"""Raw SSE framing, and every error path answered with its status and OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import pytest


def _events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event
    return [e[len("data: ") :] for e in events]


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("chat", [False, True])
def test_sse_framing(server, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert {c["object"] for c in chunks} == {kind}
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    finish = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    assert all(c["choices"][0]["index"] == 0 for c in choice_chunks)
    if chat:
        assert choice_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "stop": {"a": 1}}, "stop"),
        ({"prompt": "x", "speculation": "always"}, "speculation"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(server, body, param):
    _assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            "max_tokens",
        ),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    error = _assert_error(response, 400)
    assert error["param"] == param or param in error["message"]


def test_unknown_fields_are_ignored(server):
    body = {"prompt": "x", "max_tokens": 2, "logit_bias": {"5": 1}, "vendor_extra": [1, {}]}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_context_length_error_has_the_numbers(server):
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1000}, timeout=30
    )
    error = _assert_error(response, 400, "max_tokens")
    assert "256" in error["message"] and "1000" in error["message"]
    long_prompt = [5] * 300
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}, timeout=30
    )
    assert "300" in _assert_error(response, 400, "prompt")["message"]


def test_malformed_json_route_method_model_and_size(server):
    url = server.url
    _assert_error(httpx.post(url + "/v1/completions", content=b"{nope", timeout=30), 400)
    _assert_error(httpx.post(url + "/v1/completions", content=b"[1]", timeout=30), 400)
    _assert_error(httpx.get(url + "/v1/nothing", timeout=30), 404)
    _assert_error(httpx.get(url + "/v1/completions", timeout=30), 405)
    _assert_error(
        httpx.post(url + "/v1/completions", json={"prompt": "x", "model": "gpt-9"}, timeout=30),
        404,
        "model",
    )
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    _assert_error(httpx.post(url + "/v1/completions", content=big, timeout=30), 413)


def test_health_and_models(server):
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


def test_round_exception_fails_only_its_requests_with_500(server):
    def fail_next_round(engine):
        original = engine.executor.launch

        def failing(plan):
            engine.executor.launch = original
            raise RuntimeError("injected failure")

        engine.executor.launch = failing

    server.call(fail_next_round)
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30
    )
    _assert_error(response, 500)
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30
    )
    assert ok.status_code == 200
    stats = server.wait_idle()
    assert stats.live_slots == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_streamed_round_exception_ends_with_error_event(server):
    def fail_in_a_few_rounds(engine):
        original = engine.executor.launch
        countdown = [3]

        def failing(plan):
            countdown[0] -= 1
            if countdown[0] == 0:
                engine.executor.launch = original
                raise RuntimeError("injected failure")
            return original(plan)

        engine.executor.launch = failing

    server.call(fail_in_a_few_rounds)
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "internal_server_error"


def test_queue_full_gets_503_with_retry_after(double_server):
    server = double_server(max_concurrency=1, max_queue=1, round_s=0.01)
    body = {"prompt": "x", "max_tokens": 200, "stream": True}
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as first:
        first_chunks = first.iter_raw()  # held: dropping it would close the connection
        next(first_chunks)
        with httpx.stream("POST", url, json=body, timeout=30) as second:
            assert second.status_code == 200
            third = httpx.post(url, json=body, timeout=30)
            _assert_error(third, 503)
            assert int(third.headers["retry-after"]) >= 1


def test_broken_engine_step_fails_requests_and_keeps_serving(double_server):
    server = double_server()
    server.call(lambda engine: setattr(engine, "fail_next_step", True))
    failed = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    _assert_error(failed, 500)
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"
    assert server.stats().live_slots == 0


def test_request_timeout(double_server):
    server = double_server(round_s=0.02, request_timeout=0.3)
    body = {"prompt": "x", "max_tokens": 200}
    _assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 504)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30
    ) as r:
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout_error"
    assert server.wait_idle().live_slots == 0


def test_stream_interval_writes_several_rounds_as_one_chunk(double_server):
    server = double_server(stream_interval=4, round_s=0.02)
    body = {"prompt": "x", "max_tokens": 10}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30
    ) as r:
        events = _events(r.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert len(chunks) == 3  # rounds 1-4, 5-8, 9-10 (the finish releases early)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
