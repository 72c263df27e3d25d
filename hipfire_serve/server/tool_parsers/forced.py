"""The output formats of the constrained tool choices, which the grammar holds the model to
(`tool_choice.py` builds the grammars), as vLLM writes them:

- a named function: the whole output is that call's arguments, a JSON object;
- `required`: a JSON array of one or more calls,
  `[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]`.

Both stream: a call starts as soon as its name is known and its arguments follow as generated.
"""

from __future__ import annotations

import re

from hipfire_serve.server.tool_parsers.base import CallArgs, CallStart, ToolEvent, ToolParser
from hipfire_serve.server.tool_parsers.json_scan import JsonValueScanner, json_string

# Ends at a lookahead on the parameters' first character, so that whitespace still arriving
# cannot move the match.
_ITEM = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(?=\S)', re.DOTALL
)


class NamedCallParser(ToolParser):
    """The output is the arguments of one call of `name`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = self._start()
        if text:
            events.append(CallArgs(0, text))
        return events

    def finish(self) -> list[ToolEvent]:
        return self._start()

    def _start(self) -> list[ToolEvent]:
        if self._started:
            return []
        self._started = True
        return [CallStart(0, self._name)]


_OPEN, _ITEM_HEAD, _ARGS, _AFTER, _DONE = "open", "item", "args", "after", "done"


class CallArrayParser(ToolParser):
    """The output is a JSON array of calls, each `{"name": ..., "parameters": ...}`."""

    def __init__(self) -> None:
        self._state = _OPEN
        self._buf = ""
        self._num_calls = 0
        self._scanner = JsonValueScanner()

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        self._buf += text
        while self._buf and self._step(events):
            pass
        return events

    def _step(self, events: list[ToolEvent]) -> bool:
        """Consumes what the state can; False when it needs more text."""
        if self._state == _OPEN:
            rest = self._buf.lstrip()
            if not rest:
                self._buf = ""
                return False
            # the grammar makes it "["; any other output has no calls to show
            self._state = _ITEM_HEAD if rest[0] == "[" else _DONE
            self._buf = rest[1:]
            return True
        if self._state == _ITEM_HEAD:
            match = _ITEM.match(self._buf)
            name = json_string(match.group(1)) if match else None
            if name is None:
                return False
            events.append(CallStart(self._num_calls, name))
            self._num_calls += 1
            self._buf = self._buf[match.end() :]
            self._scanner = JsonValueScanner()
            self._state = _ARGS
            return True
        if self._state == _ARGS:
            used = self._scanner.scan(self._buf)
            if used:
                events.append(CallArgs(self._num_calls - 1, self._buf[:used]))
            self._buf = self._buf[used:]
            if self._scanner.done:
                self._state = _AFTER
            return self._scanner.done
        if self._state == _AFTER:
            # the call's closing brace, then "," before the next call or "]" at the end
            rest = self._buf.lstrip().lstrip("}").lstrip()
            if not rest:
                self._buf = ""
                return False
            self._state = _ITEM_HEAD if rest[0] == "," else _DONE
            self._buf = rest[1:]
            return True
        self._buf = ""
        return False
