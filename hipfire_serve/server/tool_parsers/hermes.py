"""The Hermes format, which Qwen 2.5/3 and Hermes models write (vLLM's `hermes` parser):

    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block becomes a call as soon as it opens with `{"name": "...", "arguments": {`; from there
its arguments stream as generated, up to the end of that JSON object. A block that does not
open so is read whole when it closes (or the output ends): a JSON object with a string `name`
and object (or string) `arguments` is a call, anything else stays in the content, tags and all.
Text outside blocks is content, except whitespace right before or after a call's block.
Content that could be the start of `<tool_call>` is held back until the next text decides it.
"""

from __future__ import annotations

import json
import re

from hipfire_serve.server.tool_parsers.base import (
    CallArgs,
    CallStart,
    Content,
    ToolEvent,
    ToolParser,
    register_tool_parser,
)
from hipfire_serve.server.tool_parsers.json_scan import (
    JsonValueScanner,
    json_string,
    partial_tag_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# Ends at a lookahead on the arguments' "{", so that a match, once the text holds it, is the
# same whatever text follows: whitespace still arriving cannot move it.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)',
    re.DOTALL,
)

_CONTENT, _BLOCK, _ARGS, _TAIL = "content", "block", "args", "tail"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        self._state = _CONTENT
        self._buf = ""  # text not yet consumed by the state
        self._held_ws = ""  # content whitespace not shown yet: dropped if a call follows it
        self._after_call = False  # whitespace that follows a call's block is dropped
        self._num_calls = 0
        self._scanner = JsonValueScanner()
        self._searched = 0  # in a block: how far the closing tag has been looked for

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        self._buf += text
        step = {_CONTENT: self._content, _BLOCK: self._block, _ARGS: self._args, _TAIL: self._tail}
        while step[self._state](events):
            pass
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._state == _CONTENT:
            self._emit_content(self._buf, events)
        elif self._state == _BLOCK:
            self._end_block(self._buf, OPEN_TAG + self._buf, events)
        self._buf = ""
        if self._held_ws:
            events.append(Content(self._held_ws))
            self._held_ws = ""
        return events

    # --- states: each consumes what it can and says whether another state takes over ---

    def _content(self, events: list[ToolEvent]) -> bool:
        start = self._buf.find(OPEN_TAG)
        if start < 0:
            keep = partial_tag_len(self._buf, OPEN_TAG)
            self._emit_content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._emit_content(self._buf[:start], events)
        self._buf = self._buf[start + len(OPEN_TAG) :]
        self._state, self._searched = _BLOCK, 0
        return True

    def _block(self, events: list[ToolEvent]) -> bool:
        # Whichever the text completes first decides: the header of a streamed call, or the
        # closing tag of a block read whole.
        buf = self._buf
        match = _HEADER.match(buf)
        name = json_string(match.group(1)) if match else None
        header_end = match.end() + 1 if match and name else None
        close = buf.find(CLOSE_TAG, max(0, self._searched - len(CLOSE_TAG) + 1))
        self._searched = len(buf)
        close_end = close + len(CLOSE_TAG) if close >= 0 else None
        if header_end is not None and (close_end is None or header_end < close_end):
            events.append(CallStart(self._num_calls, name))
            self._num_calls += 1
            self._held_ws = ""
            self._buf = buf[match.end() :]
            self._scanner = JsonValueScanner()
            self._state = _ARGS
            return True
        if close_end is None:
            return False
        self._end_block(buf[:close], OPEN_TAG + buf[:close_end], events)
        self._buf = buf[close_end:]
        self._state = _CONTENT
        return True

    def _args(self, events: list[ToolEvent]) -> bool:
        used = self._scanner.scan(self._buf)
        if used:
            events.append(CallArgs(self._num_calls - 1, self._buf[:used]))
        self._buf = self._buf[used:]
        if not self._scanner.done:
            return False
        self._state = _TAIL
        return True

    def _tail(self, events: list[ToolEvent]) -> bool:
        # the rest of the call's block (its closing brace) up to the closing tag is not shown
        close = self._buf.find(CLOSE_TAG)
        if close < 0:
            self._buf = self._buf[len(self._buf) - partial_tag_len(self._buf, CLOSE_TAG) :]
            return False
        self._buf = self._buf[close + len(CLOSE_TAG) :]
        self._after_call = True
        self._state = _CONTENT
        return True

    # --- blocks and content ---

    def _end_block(self, inner: str, raw: str, events: list[ToolEvent]) -> None:
        """A block read whole: a call, or content (`raw`, its tags included)."""
        call = _parse_call(inner)
        if call is None:
            self._emit_content(raw, events)
            return
        events += [CallStart(self._num_calls, call[0]), CallArgs(self._num_calls, call[1])]
        self._num_calls += 1
        self._held_ws = ""
        self._after_call = True

    def _emit_content(self, text: str, events: list[ToolEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            events.append(Content(self._held_ws + body))
            self._held_ws = text[len(body) :]
        else:
            self._held_ws += text


def _parse_call(inner: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's text, or None when it is not a call."""
    try:
        doc = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str) or not doc["name"]:
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    if isinstance(args, dict):
        return doc["name"], json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        return doc["name"], args
    return None
