"""Structured outputs and logit_bias through the HTTP API: the request fields that set an output
constraint (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`) as the
protocol reads them, and the official `openai` client against a live loopback server on the
real engine (tiny model, CPU, prompt-lookup speculation): JSON that validates, `parse` into a
pydantic model, streaming, and 400s in OpenAI's error shape that name the field."""

from __future__ import annotations

import json
import re

import msgspec
import openai
import pydantic
import pytest

from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_request,
    sampling_params,
    structured_outputs,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": MESSAGES, **fields}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def _param_of(**fields) -> str | None:
    req = _request(**fields)
    with pytest.raises(RequestError) as exc:
        sampling_params(req, max_tokens=16, logprobs=None)
    assert exc.value.status == 400
    return exc.value.param


# -- the protocol ------------------------------------------------------------------------------
def test_each_field_sets_the_constraint_it_names():
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    cases = [
        ({"response_format": schema_format}, ("json", "response_format.json_schema.schema")),
        ({"response_format": {"type": "json_object"}}, ("json_object", "response_format")),
        ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "structured_outputs.regex")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", "structured_outputs.choice")),
        ({"structured_outputs": {"json": SCHEMA}}, ("json", "structured_outputs.json")),
        (
            {"structured_outputs": {"grammar": 'start: "x"'}},
            ("grammar", "structured_outputs.grammar"),
        ),
        ({"guided_json": json.dumps(SCHEMA)}, ("json", "guided_json")),
        ({"guided_regex": "[0-9]+"}, ("regex", "guided_regex")),
        ({"guided_choice": ["yes", "no"]}, ("choice", "guided_choice")),
        ({"guided_grammar": 'root ::= "x"'}, ("grammar", "guided_grammar")),
    ]
    for fields, (kind, field) in cases:
        so = structured_outputs(_request(**fields))
        assert so.grammar_spec().kind == kind and so.field == field, fields
        params = sampling_params(_request(**fields), max_tokens=16, logprobs=None)
        assert params.to_spec().grammar == so.grammar_spec()
    for fields in ({}, {"response_format": {"type": "text"}}):
        assert structured_outputs(_request(**fields)) is None
    # the schema travels as its JSON text, keys in the order given (properties are generated so)
    so = structured_outputs(_request(guided_json=SCHEMA))
    assert list(json.loads(so.grammar_spec().source)["properties"]) == ["name", "age", "kind"]


def test_logit_bias_reaches_the_sampling_spec():
    params = sampling_params(
        _request(logit_bias={"5": -100, "9": 2.5}), max_tokens=4, logprobs=None
    )
    assert params.to_spec().logit_bias == ((5, -100.0), (9, 2.5))
    req = decode_request(b'{"prompt": "x", "logit_bias": {"3": 100}}', CompletionRequest)
    assert sampling_params(req, max_tokens=4, logprobs=None).to_spec().logit_bias == ((3, 100.0),)


def test_bad_constraint_fields_are_400s_naming_the_field():
    assert _param_of(response_format={"type": "xml"}) == "response_format.type"
    assert _param_of(response_format={"type": "json_schema"}) == (
        "response_format.json_schema.schema"
    )
    assert _param_of(structured_outputs={"structural_tag": {"x": 1}}) == (
        "structured_outputs.structural_tag"
    )
    assert _param_of(structured_outputs={"regex": "a", "choice": ["a"]}) == "structured_outputs"
    assert _param_of(structured_outputs={}) == "structured_outputs"
    assert _param_of(guided_json="{not json") == "guided_json"
    assert _param_of(guided_choice=[]) == "guided_choice"
    assert _param_of(guided_whitespace_pattern=" ") == "guided_whitespace_pattern"
    both = {"response_format": {"type": "json_object"}, "guided_regex": "a"}
    assert _param_of(**both) == "guided_regex"
    assert _param_of(logit_bias={"1": 101}) == "logit_bias"
    assert _param_of(logit_bias={str(i): 1 for i in range(301)}) == "logit_bias"
    assert _param_of(logit_bias={"abc": 1}) == "logit_bias"


# -- a live server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _check(doc) -> None:
    assert set(doc) == {"name", "age", "kind"} and isinstance(doc["name"], str)
    assert len(doc["name"]) <= 8 and type(doc["age"]) is int and 0 <= doc["age"] <= 99
    assert doc["kind"] in ("cat", "dog")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema(client, model, temperature):
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=120,
        temperature=temperature,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
        },
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    _check(json.loads(choice.message.content))


def test_streamed_json_schema_is_the_same_text(client, model, server):
    kwargs = dict(
        model=model,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    _check(json.loads(text))
    server.wait_idle()


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")


def test_the_clients_parse_gets_a_model_instance(client, model):
    r = client.chat.completions.parse(
        model=model, messages=MESSAGES, max_tokens=120, temperature=0.7, response_format=Pet
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_completions_take_vllm_fields_and_json_object(client, model):
    r = client.completions.create(
        model=model,
        prompt="colour: ",
        max_tokens=16,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(
        model=model,
        prompt="code: ",
        max_tokens=16,
        temperature=1.0,
        extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    r = client.completions.create(
        model=model,
        prompt="{",
        max_tokens=64,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_logit_bias_forces_a_token(client, model, server):
    token = 40
    r = client.completions.create(
        model=model, prompt="hello", max_tokens=6, temperature=1.0, logit_bias={str(token): 100}
    )
    expected = server.engine.tokenizer.decode([token] * 6)
    assert r.choices[0].text == expected


def test_api_errors_name_the_field(client, model):
    def param_of(**kwargs) -> str:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **kwargs)
        body = exc.value.body
        assert body["type"] == "invalid_request_error" and body["message"]
        return body["param"]

    bad = {"type": "object", "properties": {"a": {"type": "strng"}}}
    assert (
        param_of(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
        )
        == "response_format.json_schema.schema"
    )
    assert param_of(response_format={"type": "yaml"}) == "response_format.type"
    assert param_of(extra_body={"guided_regex": "("}) == "guided_regex"
    assert param_of(extra_body={"structured_outputs": {"grammar": "start: nope"}}) == (
        "structured_outputs.grammar"
    )
    assert param_of(logit_bias={"3": 500}) == "logit_bias"
    assert param_of(logit_bias={"999999": 5}) == "logit_bias"


def test_constraints_cross_the_process_loops_pipe_intact():
    """The child-process engine loop sends each request's SamplingParams as msgpack."""
    from hipfire_serve.server.engine_loop import AddCommand

    params = sampling_params(
        _request(guided_json=SCHEMA, logit_bias={"4": -100}), max_tokens=8, logprobs=None
    )
    command = AddCommand("r", [1, 2], params, "default", 0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(command), type=AddCommand)
    assert back.params.to_spec() == params.to_spec()
    assert back.params.structured_outputs.field == "guided_json"
