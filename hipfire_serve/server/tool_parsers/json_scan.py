"""Where one JSON value ends, in text that arrives in pieces.

The scanner follows only what decides the end: nesting of objects and arrays, strings (with
their escapes, so a `}` or `</tool_call>` inside a string is text) and the extent of a bare
scalar (number, true, false, null). It does not check the value's grammar: a call's arguments
are the model's text, as OpenAI's are. Beside it: a JSON string's value and how much of a
text's end may still grow into a tag, which the parsers hold back.
"""

from __future__ import annotations

import json

_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


class JsonValueScanner:
    """Consumes the characters of one JSON value; `done` once it has ended."""

    def __init__(self) -> None:
        self.done = False
        self._started = False
        self._scalar = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int:
        """How many leading characters of `text` belong to the value (all of them while it
        goes on; fewer once it ends, the rest being what follows it)."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if not self._started:
                if ch.isspace():
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._scalar = True
                continue
            if self._scalar:
                if ch not in _SCALAR_CHARS:
                    self.done = True
                    return i
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    self.done = self._depth == 0
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.done = self._depth == 0
        return len(text)


def json_string(raw: str) -> str | None:
    """The value of a JSON string's inside (`raw` without its quotes); None if malformed."""
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
