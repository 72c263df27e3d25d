"""Tool calling on the chat API: `tools`, `tool_choice` and `parallel_tool_calls` checked (400s
naming the field), the tools as the chat template sees them, and what the choice asks of the
output, as vLLM serves it:

- `none`: no calls; the tools are still rendered unless --exclude-tools-when-tool-choice-none;
- `auto` (the default with tools): the model decides; --tool-call-parser reads its calls;
- `required`: a grammar holds the output to a JSON array of one or more calls,
  `[{"name": ..., "parameters": {...}}]`, each call's parameters to its function's schema;
- a named function: a grammar holds the output to that function's arguments.

`parallel_tool_calls: false` keeps a reply to its first call. A constrained choice comes with
its own output constraint, so it does not take another (`response_format` and the like); nor
does `auto`, whose calls would be out of reach under one.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    RequestError,
    ToolDefinition,
    structured_outputs,
)
from hipfire_serve.server.tool_parsers import ToolParser, tool_parser_class
from hipfire_serve.server.tool_parsers.forced import CallArrayParser, NamedCallParser
from hipfire_serve.types import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names; the call formats write them inside JSON strings
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}
# the demo model's chat template writes tools and calls in the Hermes format
DEMO_TOOL_PARSER = "hermes"


@dataclass(frozen=True)
class ToolCalling:
    """The server's tool-calling settings, resolved for the served model."""

    parser: str | None = None  # the --tool-call-parser of tool_choice auto
    auto: bool = False  # tool_choice auto is served
    exclude_tools_when_none: bool = False


def resolve_tool_calling(config: Any, model: str) -> ToolCalling:
    """The `ServerConfig`'s tool flags for `model` (`--tool-call-parser auto`: hermes with auto
    tool choice for the demo model, no parser for others). ValueError on a bad combination."""
    setting = config.tool_call_parser
    auto = config.enable_auto_tool_choice
    if setting == "auto":
        parser = DEMO_TOOL_PARSER if model == "demo" else None
        auto = auto or parser is not None
    elif setting == "none":
        parser = None
    else:
        tool_parser_class(setting)
        parser = setting
    if auto and parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser: the format of the model's "
            "tool calls (e.g. hermes)"
        )
    return ToolCalling(parser, auto, config.exclude_tools_when_tool_choice_none)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: the template's `tools`, the output constraint (required,
    named) and the parser of each choice's text (none for `none`)."""

    mode: str  # none | auto | required | named
    template_tools: list[dict[str, Any]] | None
    constraint: StructuredOutputsParams | None
    new_parser: Callable[[], ToolParser] | None
    max_calls: int | None  # 1 with parallel_tool_calls false


def plan_tools(req: ChatCompletionRequest, calling: ToolCalling) -> ToolPlan | None:
    """The request's tool plan (None without tools or tool_choice); RequestError naming the
    field for anything the server cannot serve as asked."""
    tools = req.tools or []  # an empty list is no tools, as vLLM reads it
    choice = req.tool_choice
    if not tools:
        if choice is not None:
            raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    names = check_tools(tools)
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                "tool_choice",
            )
        mode, named = choice, None
    else:
        if choice.type != "function":
            where = "tool_choice.type"
            raise RequestError(f"{where} must be function, got {choice.type!r}", where)
        if choice.function is None:
            where = "tool_choice.function"
            raise RequestError(f"{where} is required with type function", where)
        if choice.function.name not in names:
            raise RequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        mode, named = "named", names.index(choice.function.name)
    if mode == "auto" and not calling.auto:
        raise RequestError(
            'tool_choice "auto" (the default with tools) needs a server started with '
            "--enable-auto-tool-choice and --tool-call-parser; this one serves tool_choice "
            '"required", a named function and "none"',
            "tool_choice",
        )
    if mode != "none":
        other = structured_outputs(req)
        if other is not None:
            field = other.field.split(".", 1)[0]
            raise RequestError(
                f"{field} cannot be combined with tool_choice {mode!r}: the output could not "
                'both follow it and call tools; send tool_choice "none" to get the format',
                field,
            )
    max_calls = None if req.parallel_tool_calls else 1
    shown = None if mode == "none" and calling.exclude_tools_when_none else template_tools(tools)
    if mode == "none":
        return ToolPlan(mode, shown, None, None, max_calls)
    if mode == "auto":
        return ToolPlan(mode, shown, None, tool_parser_class(calling.parser), max_calls)
    if mode == "named":
        function = tools[named].function
        constraint = StructuredOutputsParams(
            json=function.parameters or _NO_PARAMETERS,
            source_field=f"tools[{named}].function.parameters",
        )
        return ToolPlan(mode, shown, constraint, lambda: NamedCallParser(function.name), 1)
    constraint = StructuredOutputsParams(json=calls_schema(tools, max_calls), source_field="tools")
    return ToolPlan(mode, shown, constraint, CallArrayParser, max_calls)


def check_tools(tools: list[ToolDefinition]) -> list[str]:
    """The tools' function names; RequestError naming the field of a tool not served."""
    names: list[str] = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            where = f"tools[{i}].type"
            raise RequestError(f"{where}: only function tools are served, got {tool.type!r}", where)
        if tool.function is None:
            where = f"tools[{i}].function"
            raise RequestError(f"{where} is required with type function", where)
        name = tool.function.name
        if not _TOOL_NAME.fullmatch(name):
            where = f"tools[{i}].function.name"
            raise RequestError(
                f"{where} must be 1-64 letters, digits, '_' or '-', got {name!r}", where
            )
        if name in names:
            raise RequestError(f"tools name the function {name!r} twice", "tools")
        names.append(name)
    return names


def template_tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as chat templates read them (OpenAI's shape, unset keys left out)."""
    out = []
    for tool in tools:
        function = tool.function
        entry: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            entry["description"] = function.description
        if function.parameters is not None:
            entry["parameters"] = function.parameters
        out.append({"type": "function", "function": entry})
    return out


def calls_schema(tools: list[ToolDefinition], max_calls: int | None) -> dict[str, Any]:
    """The JSON schema of `required`'s output: an array of calls, each one of the tools by
    name with its parameters. Every tool's `$defs` (and `definitions`) move to the root,
    where their `#/$defs/...` references point."""
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for i, tool in enumerate(tools):
        parameters = copy.copy(tool.function.parameters or _NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            found = parameters.pop(key, None)
            if found is None:
                continue
            where = f"tools[{i}].function.parameters"
            if not isinstance(found, dict):
                raise RequestError(f"{where}.{key} must be an object", where)
            shared = defs.setdefault(key, {})
            for name, schema in found.items():
                if shared.setdefault(name, schema) != schema:
                    raise RequestError(
                        f"{where}.{key}.{name} differs from another tool's {key}.{name}; under "
                        'tool_choice "required" the tools\' definitions share one namespace',
                        where,
                    )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    schema.update(defs)
    return schema
