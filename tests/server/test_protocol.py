"""Request decoding: wrong types and out-of-range values become errors naming the field."""

from __future__ import annotations

import pytest

from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_messages,
    decode_request,
    prompt_inputs,
    sampling_params,
)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "x", "stop": [1]}', "stop[0]"),
        (b'{"prompt": "x", "n": true}', "n"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        (b'{"prompt": "x", "seed": 1.5}', "seed"),
        (b'{"prompt": "x", "top_p": 1e999}', "top_p"),
    ],
)
def test_wrong_types_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        decode_request(body, CompletionRequest)
    assert info.value.param == param and info.value.status == 400


def test_malformed_and_non_object_bodies():
    for body in (b"{", b"", b"[1, 2]", b'"text"', b"\xff\xfe"):
        with pytest.raises(RequestError):
            decode_request(body, CompletionRequest)


def test_unknown_fields_are_ignored():
    req = decode_request(
        b'{"prompt": "x", "logit_bias": {"1": 2}, "frobnicate": [1]}', CompletionRequest
    )
    assert req.prompt == "x"


def test_prompt_shapes():
    assert prompt_inputs("a") == ["a"]
    assert prompt_inputs(["a", "b"]) == ["a", "b"]
    assert prompt_inputs([1, 2]) == [[1, 2]]
    assert prompt_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (None, [], [[]], ["a", 1], [-1], [True], 3, {"a": 1}, [[1], "a"]):
        with pytest.raises(RequestError) as info:
            prompt_inputs(bad)
        assert info.value.param == "prompt"


def test_chat_messages_roles_and_text_parts():
    req = decode_request(
        b'{"messages": [{"role": "developer", "content": "be brief"},'
        b'{"role": "user", "content": [{"type": "text", "text": "a"},'
        b'{"type": "text", "text": "b"}]},'
        b'{"role": "assistant", "content": null}]}',
        ChatCompletionRequest,
    )
    assert chat_messages(req.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    bad_role = decode_request(
        b'{"messages": [{"role": "function", "content": "x"}]}', ChatCompletionRequest
    )
    with pytest.raises(RequestError) as info:
        chat_messages(bad_role.messages)
    assert info.value.param == "messages[0].role"
    with pytest.raises(RequestError):
        chat_messages([])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("n", 1000),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("speculation", "maybe"),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    req = CompletionRequest(prompt="x", **{field: value})
    with pytest.raises(RequestError) as info:
        sampling_params(req, max_tokens=4, logprobs=None)
    assert info.value.param == field


def test_sampling_params_carry_the_request():
    req = CompletionRequest(
        prompt="x",
        temperature=0.0,
        top_k=5,
        seed=-3,
        n=2,
        stop="\n",
        ignore_eos=True,
        speculation="off",
    )
    params = sampling_params(req, max_tokens=7, logprobs=2)
    assert (params.temperature, params.top_k, params.n, params.max_tokens) == (0.0, 5, 2, 7)
    assert params.seed == (-3) % (1 << 63) and params.logprobs == 2
    assert params.stop_strings == ("\n",) and params.ignore_eos and params.speculation == "off"
    assert sampling_params(CompletionRequest(prompt="x"), max_tokens=1, logprobs=None).top_p == 1.0
    with pytest.raises(RequestError) as info:
        sampling_params(req, max_tokens=0, logprobs=None)
    assert info.value.param == "max_tokens"
