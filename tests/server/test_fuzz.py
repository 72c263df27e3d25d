"""Schema fuzzing: request bodies of any shape and value never get a 5xx from the real server."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
any_json = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.integers(-3, 6)
token_ids = st.lists(st.integers(-2, 400), min_size=0, max_size=8)

SAMPLING = {
    "model": st.one_of(st.just("tiny-llama"), any_json),
    "max_tokens": st.one_of(small_ints, st.integers(-(2**64), 2**64), any_json),
    "temperature": st.one_of(st.floats(-1, 3), any_json),
    "top_p": st.one_of(st.floats(-0.5, 1.5), any_json),
    "top_k": st.one_of(small_ints, any_json),
    "min_p": st.one_of(st.floats(-0.5, 1.5), any_json),
    "seed": st.one_of(st.integers(-(2**70), 2**70), any_json),
    "n": st.one_of(st.integers(-1, 3), any_json),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20), any_json),
    "stop_token_ids": st.one_of(token_ids, any_json),
    "presence_penalty": st.one_of(st.floats(-3, 3), any_json),
    "frequency_penalty": st.one_of(st.floats(-3, 3), any_json),
    "repetition_penalty": st.one_of(st.floats(-1, 11), any_json),
    "ignore_eos": st.one_of(st.booleans(), any_json),
    "min_tokens": st.one_of(small_ints, any_json),
    "stream": st.one_of(st.booleans(), any_json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), any_json),
    "user": any_json,
    "speculation": st.one_of(st.sampled_from(["auto", "on", "off", "x"]), any_json),
}
COMPLETION = {
    **SAMPLING,
    "prompt": st.one_of(
        st.text(max_size=20),
        st.lists(st.text(max_size=8), max_size=3),
        token_ids,
        st.lists(token_ids, max_size=3),
        any_json,
    ),
    "logprobs": st.one_of(st.integers(-1, 25), any_json),
    "echo": st.one_of(st.booleans(), any_json),
    "suffix": any_json,
}
message = st.fixed_dictionaries(
    {
        "role": st.one_of(
            st.sampled_from(["system", "user", "assistant", "developer", "tool"]), any_json
        ),
        "content": st.one_of(
            st.text(max_size=20),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                max_size=2,
            ),
            any_json,
        ),
    },
)
CHAT = {
    **SAMPLING,
    "messages": st.one_of(st.lists(message, max_size=3), any_json),
    "max_completion_tokens": st.one_of(small_ints, any_json),
    "logprobs": st.one_of(st.booleans(), any_json),
    "top_logprobs": st.one_of(st.integers(-1, 25), any_json),
}


def _bodies(fields: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields).map(_cap_work)


def _cap_work(body: dict) -> dict:
    # Keep generation short so the fuzz budget goes to shapes, not to decoding.
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 6:
            body[key] = 6
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    return body


FUZZ_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@FUZZ_SETTINGS
@given(body=_bodies(COMPLETION))
def test_completions_never_5xx(http, body):
    response = http.post("/v1/completions", json=body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ_SETTINGS
@given(body=_bodies(CHAT))
def test_chat_never_5xx(http, body):
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@FUZZ_SETTINGS
@given(raw=st.one_of(st.binary(max_size=64), any_json.map(lambda v: repr(v).encode())))
def test_raw_bytes_never_5xx(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert http.post(path, content=raw).status_code < 500
