"""Incremental parser for Server-Sent Events (the `text/event-stream` wire format).

Bytes arrive in arbitrary pieces: a line, an event or a multi-byte character may be split across
network reads, so the parser keeps the unfinished tail between `feed` calls. Only what OpenAI-style
streams use is interpreted: `data` lines (several in one event are joined with a newline), `event`
names, and blank lines that end an event; comment lines (starting with ':') keep a connection alive
and are skipped, as are `id`/`retry` fields.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class SSEvent:
    data: str
    event: str = "message"


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []
        self._event = ""
        self._pending_cr = False  # a '\r' ended the last piece: a following '\n' is the same break

    def feed(self, chunk: bytes) -> list[SSEvent]:
        """Consume bytes; return the events completed by them."""
        text = self._decoder.decode(chunk)
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = False
        self._buffer += text
        events: list[SSEvent] = []
        while True:
            cut = _line_break(self._buffer)
            if cut is None:
                break
            end, width = cut
            if width == 1 and self._buffer[end] == "\r" and end + 1 == len(self._buffer):
                self._pending_cr = True  # maybe the first half of a '\r\n' split across reads
            line, self._buffer = self._buffer[:end], self._buffer[end + width :]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEvent]:
        """End of stream: a final event without its blank line still counts."""
        events = self.feed(b"")
        if self._buffer:
            event = self._line(self._buffer)
            self._buffer = ""
            if event is not None:
                events.append(event)
        event = self._line("")
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: str) -> SSEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SSEvent(data="\n".join(self._data), event=self._event or "message")
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def _line_break(text: str) -> tuple[int, int] | None:
    """(index, width) of the first line break: '\r\n', '\r' or '\n'."""
    n = text.find("\n")
    r = text.find("\r")
    if r == -1 and n == -1:
        return None
    if r == -1 or (n != -1 and n < r):
        return n, 1
    if r + 1 < len(text) and text[r + 1] == "\n":
        return r, 2
    return r, 1
