"""Tool calling through the HTTP API with the official `openai` client on loopback.

The real engine (tiny random model, CPU, the demo's chat template through --chat-template)
serves `tool_choice: required` and named functions: the grammar makes even an untrained model
write a call whose arguments follow the schema, streamed exactly as returned whole. History
with assistant calls and tool results is rendered in the Hermes format. `auto` parsing is
shown on a scripted engine double that writes given text a character per round, so every
cut of the text into stream deltas is exercised."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from hipfire_serve.config import EngineConfig
from hipfire_serve.demo.tokenizer import CHAT_TEMPLATE
from hipfire_serve.server.config import ServerConfig
from hipfire_serve.types import CompletionOutput
from tests.server.conftest import RunningServer, start_real_server
from tests.server.engine_double import NUM_SPECIAL, ByteTokenizer, EngineDouble

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 6}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_arguments(name: str, arguments: str) -> None:
    """The arguments against the function's schema (the keywords these schemas use)."""
    schema, doc = SCHEMAS[name], json.loads(arguments)
    assert isinstance(doc, dict) and set(schema["required"]) <= set(doc) <= set(
        schema["properties"]
    )
    for key, value in doc.items():
        rule = schema["properties"][key]
        if "enum" in rule:
            assert value in rule["enum"]
        elif rule["type"] == "string":
            assert isinstance(value, str) and len(value) <= rule["maxLength"]
        else:
            assert type(value) is int and rule["minimum"] <= value <= rule["maximum"]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory) -> Iterator[RunningServer]:
    from tests.fixtures.tiny_models import make_tiny_model

    folder = tmp_path_factory.mktemp("tool-model")
    # the tiny tokenizer spends most of a thousand tokens on the tools: a longer context
    model_dir = make_tiny_model(folder / "tiny-llama", max_position_embeddings=2048)
    template = folder / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    running = start_real_server(
        model_dir,
        chat_template=str(template),
        engine_overrides={"max_model_len": 2048},
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, **kwargs):
    body = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=160, seed=7)
    return client.chat.completions.create(**{**body, **kwargs})


def _reassemble(chunks) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason) of a chat stream, checking that each
    call's first delta carries its id, type and name and later ones only arguments."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("call_") and call.type == "function"
                    assert call.function.name and call.function.arguments is not None
                    calls[call.index] = [call.id, call.function.name, call.function.arguments]
                else:
                    assert call.id is None and call.type is None and call.function.name is None
                    calls[call.index][2] += call.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


# -- constrained choices on the real engine ------------------------------------------------------
# Greedy, an untrained model may go on adding calls to the array until max_tokens: greedy
# cases keep to one call.
@pytest.mark.parametrize(("temperature", "parallel"), [(1.0, True), (0.0, False)])
def test_required_gives_calls_that_follow_the_schemas(client, temperature, parallel):
    r = _create(
        client, tool_choice="required", temperature=temperature, parallel_tool_calls=parallel
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert re.fullmatch("call_[0-9a-f]{24}", call.id) and call.type == "function"
        _check_arguments(call.function.name, call.function.arguments)


def test_a_named_function_and_one_call_without_parallel_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _create(client, tool_choice=named, temperature=1.0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    _check_arguments("get_time", call.function.arguments)
    r = _create(client, tool_choice="required", parallel_tool_calls=False, n=2, temperature=1.0)
    assert [len(c.message.tool_calls) for c in r.choices] == [1, 1]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_are_the_calls_returned_whole(client, tool_server, tool_choice):
    kwargs = dict(tool_choice=tool_choice, temperature=0, parallel_tool_calls=False)
    whole = _create(client, **kwargs).choices[0]
    content, calls, finish = _reassemble(_create(client, **kwargs, stream=True))
    assert content is None and finish == whole.finish_reason == "tool_calls"
    assert [(name, args) for _, name, args in calls] == _calls(whole.message)
    for _, name, args in calls:
        _check_arguments(name, args)
    tool_server.wait_idle()


# -- history, rendering and auto on the real engine ----------------------------------------------
HISTORY = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "18 C and sunny"},
]


def test_history_with_calls_and_tool_results_is_rendered(client, tool_server):
    body = {"model": "tiny-llama", "messages": HISTORY, "tools": TOOLS}
    tokens = httpx.post(tool_server.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(tool_server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_time"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    r = client.chat.completions.create(
        model="tiny-llama", messages=HISTORY, tools=TOOLS, max_tokens=4, tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == len(tokens)


def test_auto_text_without_calls_is_content(client):
    r = _create(client, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0
    )
    message = r.choices[0].message
    assert message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    content, calls, _ = _reassemble(_create(client, max_tokens=12, temperature=0, stream=True))
    assert calls == [] and content == message.content


def test_bad_tool_requests_are_400s_naming_the_field(client):
    def param_of(**kwargs) -> str:
        with pytest.raises(openai.BadRequestError) as exc:
            _create(client, max_tokens=4, **kwargs)
        assert exc.value.body["type"] == "invalid_request_error" and exc.value.body["message"]
        return exc.value.body["param"]

    unknown = {"type": "function", "function": {"name": "get_stock"}}
    assert param_of(tool_choice=unknown) == "tool_choice"
    assert param_of(tools="get_weather") == "tools"
    assert param_of(tools=[{"type": "function", "function": {"name": "x y"}}]) == (
        "tools[0].function.name"
    )
    assert param_of(response_format={"type": "json_object"}) == "response_format"
    bad = {"type": "object", "properties": {"a": {"type": "strng"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    assert param_of(tools=tools, tool_choice="required") == "tools"
    named = {"type": "function", "function": {"name": "f"}}
    assert param_of(tools=tools, tool_choice=named) == "tools[0].function.parameters"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=4, tool_choice="required"
        )
    assert exc.value.body["param"] == "tool_choice"


def test_auto_needs_the_flag(server):
    """The shared server runs without --tool-call-parser: auto is refused, required served."""
    plain = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        plain.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS)
    assert exc.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in exc.value.body["message"]
    r = _create(plain, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert r.choices[0].message.tool_calls


# -- auto on a scripted engine -------------------------------------------------------------------
SCRIPT = (
    "Checking both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


class _ScriptTokenizer(ByteTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **_) -> str:
        return super().apply_chat_template(messages, add_generation_prompt)


class ScriptedEngine(EngineDouble):
    """Writes the text between `SAY[` and `]END` in the prompt, one character per round,
    and stops after it as a model's end-of-sequence would."""

    def __init__(self) -> None:
        super().__init__(max_model_len=4096)
        self.tokenizer = _ScriptTokenizer()

    def _advance(self, r, c) -> CompletionOutput:
        prompt = self.tokenizer.decode(r.prompt_ids)
        script = prompt[prompt.rindex("SAY[") + 4 : prompt.rindex("]END")]
        piece = script[len(c.token_ids)]
        token = ord(piece) + NUM_SPECIAL
        c.token_ids.append(token)
        finish = "stop" if len(c.token_ids) == len(script) else None
        if finish is None and len(c.token_ids) >= r.params.max_tokens:
            finish = "length"
        c.finished = finish is not None
        return CompletionOutput(index=c.index, text=piece, token_ids=[token], finish_reason=finish)


@pytest.fixture(scope="module")
def scripted_client() -> Iterator[openai.OpenAI]:
    config = ServerConfig(
        port=0, log_level="warning", tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    running = RunningServer(ScriptedEngine(), EngineConfig(model="double"), config).start()
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
    running.stop()


def _say(client: openai.OpenAI, text: str, **kwargs):
    messages = [{"role": "user", "content": f"SAY[{text}]END"}]
    return client.chat.completions.create(
        model="double", messages=messages, tools=TOOLS, max_tokens=400, **kwargs
    )


def test_auto_reads_hermes_calls_whole_and_streamed(scripted_client):
    choice = _say(scripted_client, SCRIPT).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
    expected = [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("get_time", '{"tz": "CET"}'),
    ]
    assert _calls(choice.message) == expected
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, calls, finish = _reassemble(_say(scripted_client, SCRIPT, stream=True))
    assert (content, [(n, a) for _, n, a in calls], finish) == (
        "Checking both.",
        expected,
        "tool_calls",
    )
    # the client library's own stream accumulation reads the same
    with scripted_client.chat.completions.stream(
        model="double",
        messages=[{"role": "user", "content": f"SAY[{SCRIPT}]END"}],
        tools=TOOLS,
        max_tokens=400,
    ) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == expected


def test_auto_keeps_malformed_blocks_as_content_and_one_call_without_parallel(scripted_client):
    text = "Hmm <tool_call>{not json}</tool_call> done"
    for stream in (False, True):
        if stream:
            content, calls, finish = _reassemble(_say(scripted_client, text, stream=True))
        else:
            choice = _say(scripted_client, text).choices[0]
            content, calls, finish = choice.message.content, [], choice.finish_reason
            assert choice.message.tool_calls is None
        assert (content, calls, finish) == (text, [], "stop")
    r = _say(scripted_client, SCRIPT, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    r = _say(scripted_client, SCRIPT, tool_choice="none")
    assert r.choices[0].message.content == SCRIPT and r.choices[0].finish_reason == "stop"
