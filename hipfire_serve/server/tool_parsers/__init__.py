"""Tool-call parsers: a choice's generated text, as it streams, split into content and calls.

A parser is fed the text deltas of one choice in order and answers each with events: `Content`
(text for `message.content`), `CallStart` (a new call and its function's name) and `CallArgs`
(the next piece of that call's `arguments`). Its events are a function of the text alone, never
of how the text was cut into deltas, so a stream reassembles to exactly the reply a
non-streamed request gets (which is the whole text fed at once, then `finish`).

Parsers for `tool_choice: auto` are looked up by name (`--tool-call-parser`); a new format
registers its class with `@register_tool_parser("name")`. The formats of the constrained
choices (`required`, a named function) live in `forced.py`.
"""

from __future__ import annotations

from hipfire_serve.server.tool_parsers import hermes
from hipfire_serve.server.tool_parsers.base import (
    CallArgs,
    CallStart,
    Content,
    ToolEvent,
    ToolParser,
    register_tool_parser,
    tool_parser_class,
    tool_parser_names,
)

__all__ = [
    "CallArgs",
    "CallStart",
    "Content",
    "ToolEvent",
    "ToolParser",
    "hermes",
    "register_tool_parser",
    "tool_parser_class",
    "tool_parser_names",
]
