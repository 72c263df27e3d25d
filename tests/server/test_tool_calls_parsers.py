"""Tool calling without a server: the Hermes parser and the constrained formats' parsers (content
and calls, malformed blocks, any cut of the text into deltas giving the same result), the
stream deltas' shape, the request checks and their 400s, the grammar of `required`, the
server flags, and the demo chat template's tool rendering read back by the parser."""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hipfire_serve.config import EngineConfig
from hipfire_serve.demo import demo_draft_dir, demo_model_dir
from hipfire_serve.demo.tokenizer import CHAT_TEMPLATE
from hipfire_serve.server.config import ServerConfig, resolve
from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    RequestError,
    chat_messages,
    decode_request,
)
from hipfire_serve.server.tool_choice import ToolCalling, calls_schema, plan_tools
from hipfire_serve.server.tool_choice import resolve_tool_calling as resolve_calling
from hipfire_serve.server.tool_parsers import (
    CallArgs,
    CallStart,
    Content,
    ToolParser,
    tool_parser_class,
    tool_parser_names,
)
from hipfire_serve.server.tool_parsers.forced import CallArrayParser, NamedCallParser
from hipfire_serve.server.tool_stream import ChoiceTools
from hipfire_serve.tokenizer import compile_chat_template

Hermes = tool_parser_class("hermes")


def _collect(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of the text fed in `pieces`, then finished."""
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, CallArgs) and event.index == len(calls) - 1
            calls[event.index][1] += event.text
    return content, [tuple(c) for c in calls]


def _cut(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
TWO_CALLS = (
    "Let me look.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "a}</tool_call>\\"{"}}\n</tool_call>'
)


# -- the Hermes parser -------------------------------------------------------------------------
def test_hermes_content_and_several_calls():
    content, calls = _collect(Hermes(), [TWO_CALLS])
    assert content == "Let me look."
    assert calls == [
        ("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ("get_time", '{"tz": "a}</tool_call>\\"{"}'),  # tags and braces inside strings are text
    ]
    # text between and after calls is content; the whitespace around the blocks is not
    text = f"<tool_call>{WEATHER}</tool_call>\n then \n<tool_call>{WEATHER}</tool_call>\n\n"
    content, calls = _collect(Hermes(), [text])
    assert content == "then" and len(calls) == 2
    # a block read whole: keys in another order, arguments as a JSON string
    other = '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call><tool_call>{"name": "g"'
    other += ', "arguments": "{\\"y\\": 2}"}</tool_call>'
    assert _collect(Hermes(), [other]) == ("", [("f", '{"x": 1}'), ("g", '{"y": 2}')])


def test_plain_text_is_content_as_it_is():
    for text in ("", "  plain  text\n", "a < b and <tool_ but no call", "<tool_call", "x <"):
        assert _collect(Hermes(), [text]) == (text, [])


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "f", "arguments": }</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>["f", {}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "argu',  # the output ended inside a block that is no call
    ],
)
def test_malformed_blocks_stay_content(block):
    text = f"Before. {block} after"
    assert _collect(Hermes(), [text]) == (text, [])
    assert _collect(Hermes(), list(text)) == (text, [])


def test_a_call_cut_short_keeps_what_was_generated():
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": "unfinish'
    assert _collect(Hermes(), [text]) == ("ok", [("f", '{"a": "unfinish')])


def test_content_that_may_start_a_tag_is_held_back():
    parser = Hermes()
    assert parser.feed("Hi <tool") == [Content("Hi")]
    assert parser.feed("box>") == [Content(" <toolbox>")]
    assert parser.feed(" <tool_call>") == []  # the space waits for what the block becomes
    assert parser.feed('{"name": "f", "arguments": {') == [CallStart(0, "f"), CallArgs(0, "{")]


HERMES_TEXTS = [
    TWO_CALLS,
    "Before. <tool_call>{not json}</tool_call> after",
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call> tail ',
    'ok <tool_call>\n{"name": "f", "arguments": {"a": "unfinish',
    '<tool_call>{"name": "a\\"</tool_call>", "arguments": {"q": "\\\\"}}</tool_call>x',
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_every_split_point_gives_the_same_result(text):
    whole = _collect(Hermes(), [text])
    assert _collect(Hermes(), list(text)) == whole
    for k in range(len(text) + 1):
        assert _collect(Hermes(), [text[:k], text[k:]]) == whole, k


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    '{"name": "f", "arguments": ',
    '{"name": "g\\"", "arguments": ',
    '{"arguments": {}, "name": "h"}',
    "{",
    "}",
    '"',
    '"x}"',
    "[1, 2]",
    "\\",
    " ",
    "\n",
    "text",
    ", ",
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.sets(st.integers(1, 200), max_size=12),
)
@example('<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_call>', {5, 30})
@example(' <tool_call>{"arguments": {}, "name": "h"}</tool_call> ', {1, 2, 12})
def test_any_chunking_gives_the_same_result(text, cuts):
    whole = _collect(Hermes(), [text])
    assert _collect(Hermes(), _cut(text, cuts)) == whole
    content, calls = whole
    if not calls:
        assert content == text  # without calls nothing is lost or added


# -- the constrained formats ------------------------------------------------------------------
ARRAY = '[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}}, {"name": "b", "parameters": 5}]'


def test_call_array_and_named_arguments():
    assert _collect(CallArrayParser(), [ARRAY]) == (
        "",
        [("a", '{"x": [1, {"y": "]}"}]}'), ("b", "5")],
    )
    for k in range(len(ARRAY) + 1):
        assert _collect(CallArrayParser(), [ARRAY[:k], ARRAY[k:]]) == _collect(
            CallArrayParser(), [ARRAY]
        )
    assert _collect(CallArrayParser(), list(ARRAY[:47])) == ("", [("a", '{"x": [1, {"y": "]')])
    args = '{"city": "Paris"}'
    assert _collect(NamedCallParser("get_weather"), list(args)) == ("", [("get_weather", args)])
    assert _collect(NamedCallParser("f"), []) == ("", [("f", "")])


# -- stream deltas -----------------------------------------------------------------------------
def _encoded(deltas) -> list[dict]:
    return [msgspec.to_builtins(d) for d in deltas]


def test_deltas_carry_openai_shapes():
    tools = ChoiceTools(Hermes(), max_calls=None)
    deltas = _encoded(tools.feed("Hi.\n<tool_call>\n" + WEATHER[:40], final=False))
    assert deltas[0] == {"content": "Hi."}
    first = deltas[1]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function"
    assert first["id"].startswith("call_") and len(first["id"]) == 29
    assert first["function"] == {"name": "get_weather", "arguments": '{"c'}
    later = _encoded(tools.feed(WEATHER[40:] + "</tool_call>", final=True))
    assert later == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ity": "Paris", "days": [1, 2]}'}}]}
    ]
    assert tools.finish_reason("stop") == "tool_calls" and tools.finish_reason("length") == "length"
    message = msgspec.to_builtins(tools.message())
    assert message["content"] == "Hi."
    assert message["tool_calls"] == [
        {
            "id": first["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
        }
    ]


def test_one_call_without_parallel_tool_calls():
    tools = ChoiceTools(Hermes(), max_calls=1)
    tools.feed(TWO_CALLS, final=True)
    message = msgspec.to_builtins(tools.message())
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    plain = ChoiceTools(Hermes(), max_calls=None)
    plain.feed("no calls", final=True)
    assert msgspec.to_builtins(plain.message()) == {
        "role": "assistant",
        "content": "no calls",
        "refusal": None,
    }
    assert plain.finish_reason("stop") == "stop"


# -- the request ---------------------------------------------------------------------------------
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Now."}},
]
AUTO = ToolCalling(parser="hermes", auto=True)


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def _param_of(calling: ToolCalling = AUTO, **fields) -> str | None:
    with pytest.raises(RequestError) as exc:
        plan_tools(_request(**fields), calling)
    assert exc.value.status == 400 and exc.value.message
    return exc.value.param


def test_bad_tool_fields_are_400s_naming_the_field():
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": named}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "custom"}}, "tool_choice.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ]
    for fields, param in cases:
        assert _param_of(**fields) == param, fields
    # tool_choice auto (the default with tools) needs --enable-auto-tool-choice
    assert _param_of(ToolCalling(), tools=TOOLS) == "tool_choice"
    # a constraint is fine where no call can be made
    plan = plan_tools(_request(tools=TOOLS, tool_choice="none", guided_regex="a"), AUTO)
    assert plan.mode == "none" and plan.new_parser is None


def test_decoding_errors_name_the_field():
    for body, param in (
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ):
        with pytest.raises(RequestError) as exc:
            _request(**body)
        assert exc.value.param == param, body


def test_tool_plans():
    plan = plan_tools(_request(tools=TOOLS), AUTO)
    assert plan.mode == "auto" and plan.constraint is None and plan.new_parser is Hermes
    assert plan.template_tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
        {"type": "function", "function": {"name": "get_time", "description": "Now."}},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(_request(tools=TOOLS, tool_choice=named), ToolCalling())
    assert (
        plan.constraint.json == PARAMS and plan.constraint.field == "tools[0].function.parameters"
    )
    assert isinstance(plan.new_parser(), NamedCallParser)
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required"), ToolCalling())
    assert plan.constraint.field == "tools" and plan.constraint.json["minItems"] == 1
    assert "maxItems" not in plan.constraint.json
    one = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), AUTO)
    assert one.constraint.json["maxItems"] == 1 and one.max_calls == 1
    hidden = ToolCalling(exclude_tools_when_none=True)
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), hidden).template_tools is None
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), AUTO).template_tools
    assert plan_tools(_request(), AUTO) is None and plan_tools(_request(tools=[]), AUTO) is None


def test_required_schema_hoists_definitions():
    ref = {"$ref": "#/$defs/place"}
    with_defs = {
        "type": "object",
        "properties": {"at": ref},
        "$defs": {"place": {"type": "string"}},
    }
    tools = _request(
        tools=[
            {"type": "function", "function": {"name": "a", "parameters": with_defs}},
            {"type": "function", "function": {"name": "b", "parameters": with_defs}},
        ]
    ).tools
    schema = calls_schema(tools, None)
    assert schema["$defs"] == {"place": {"type": "string"}}
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"const": "a"} and "$defs" not in first["properties"]
    assert "$defs" in tools[0].function.parameters  # the request's own schema is left as it was
    clash = {**with_defs, "$defs": {"place": {"type": "integer"}}}
    tools[1].function.parameters = clash
    with pytest.raises(RequestError) as exc:
        calls_schema(tools, None)
    assert exc.value.param == "tools[1].function.parameters"


@settings(max_examples=150, deadline=None)
@given(
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["type", "function", "name", "x"]), inner, max_size=3),
        ),
        max_leaves=10,
    ),
    st.one_of(st.none(), st.sampled_from(["auto", "none", "required", "x"]), st.integers()),
)
def test_any_tools_value_is_served_or_a_400(tools, tool_choice):
    body = msgspec.json.encode(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": tool_choice,
        }
    )
    try:
        plan_tools(decode_request(body, ChatCompletionRequest), AUTO)
    except RequestError as exc:
        assert exc.status == 400 and exc.param


# -- history -------------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_history_messages_as_templates_read_them():
    messages = chat_messages(_request(messages=HISTORY).messages)
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    bad_args = json.loads(json.dumps(HISTORY))
    bad_args[1]["tool_calls"][0]["function"]["arguments"] = "{oops"
    no_id = [*HISTORY[:2], {"role": "tool", "content": "18 C"}]
    user_calls = [{**HISTORY[1], "role": "user"}]
    for messages, param in (
        (bad_args, "messages[1].tool_calls[0].function.arguments"),
        (no_id, "messages[2].tool_call_id"),
        (user_calls, "messages[0].tool_calls"),
    ):
        with pytest.raises(RequestError) as exc:
            chat_messages(_request(messages=messages).messages)
        assert exc.value.param == param


def test_demo_template_renders_calls_the_parser_reads_back():
    template = compile_chat_template(CHAT_TEMPLATE)
    messages = chat_messages(_request(messages=HISTORY).messages)
    tools = plan_tools(_request(tools=TOOLS), AUTO).template_tools
    text = template.render(messages=messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(tools[0]) in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert (
        turn == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert _collect(Hermes(), [turn]) == ("", [("get_weather", '{"city": "Paris"}')])
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in text
    # without tools the template writes what the model was trained on
    plain = template.render(messages=[{"role": "user", "content": "u"}], add_generation_prompt=True)
    assert plain == "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"


def test_the_shipped_demo_models_carry_the_template():
    for directory in (demo_model_dir(), demo_draft_dir()):
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHAT_TEMPLATE


# -- the server's flags --------------------------------------------------------------------------
def test_tool_flags():
    assert "hermes" in tool_parser_names()
    assert resolve_calling(ServerConfig(), "demo") == ToolCalling("hermes", True)
    assert resolve_calling(ServerConfig(), "/models/x") == ToolCalling(None, False)
    explicit = ServerConfig(tool_call_parser="hermes")
    assert resolve_calling(explicit, "demo") == ToolCalling("hermes", False)
    assert resolve_calling(ServerConfig(tool_call_parser="none"), "demo") == ToolCalling()
    on = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert resolve_calling(on, "/models/x") == ToolCalling("hermes", True)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        resolve_calling(ServerConfig(enable_auto_tool_choice=True), "/models/x")
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        resolve(["--tool-call-parser", "none", "--enable-auto-tool-choice"])
    _, server = resolve(["--tool-call-parser", "hermes", "--exclude-tools-when-tool-choice-none"])
    assert server.tool_call_parser == "hermes" and server.exclude_tools_when_tool_choice_none
    assert EngineConfig().model == "demo"  # the default server is the demo's: hermes, auto on
