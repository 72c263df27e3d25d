"""A choice's tool calls as the reply shows them: its parser's events as stream deltas in
OpenAI's shape (a call's first delta carries `index`, `id`, `type` and `function.name`, later
ones `index` and the next `function.arguments` piece), and the message's `content` and
`tool_calls` once the text is whole. Call ids are `call_` and 24 hex digits."""

from __future__ import annotations

import uuid

from hipfire_serve.server.protocol import (
    AssistantMessage,
    ChatDelta,
    FunctionDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
)
from hipfire_serve.server.tool_parsers import CallArgs, CallStart, Content, ToolEvent, ToolParser


class ChoiceTools:
    """One choice's calls: its parser's events as stream deltas in OpenAI's shape, and the
    reply's content and `tool_calls` once the text is whole."""

    def __init__(self, parser: ToolParser, max_calls: int | None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.content_parts: list[str] = []
        self.calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces)

    def feed(self, text: str, final: bool) -> list[ChatDelta]:
        """The deltas of the next piece of text (`final`: the output ends after it)."""
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return self._deltas(events)

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for an output that ended by itself with calls in it."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self, prefix: str = "") -> AssistantMessage:
        content = prefix + "".join(self.content_parts)
        if not self.calls:
            return AssistantMessage(content=content)
        calls = [
            ToolCall(id=call_id, function=ToolCallFunction(name=name, arguments="".join(args)))
            for call_id, name, args in self.calls
        ]
        return AssistantMessage(content=content or None, tool_calls=calls)

    def _kept(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls

    def _deltas(self, events: list[ToolEvent]) -> list[ChatDelta]:
        deltas: list[ChatDelta] = []
        for event in events:
            last = deltas[-1] if deltas else None
            if isinstance(event, Content):
                self.content_parts.append(event.text)
                if last is not None and last.content is not None:
                    last.content += event.text
                else:
                    deltas.append(ChatDelta(content=event.text))
            elif isinstance(event, CallStart):
                if not self._kept(event.index):
                    continue
                call_id = "call_" + uuid.uuid4().hex[:24]
                self.calls.append((call_id, event.name, []))
                function = FunctionDelta(name=event.name, arguments="")
                delta = ToolCallDelta(
                    index=event.index, id=call_id, type="function", function=function
                )
                deltas.append(ChatDelta(tool_calls=[delta]))
            elif isinstance(event, CallArgs) and self._kept(event.index):
                self.calls[event.index][2].append(event.text)
                if last is not None and last.tool_calls and last.tool_calls[0].index == event.index:
                    last.tool_calls[0].function.arguments += event.text
                else:
                    function = FunctionDelta(arguments=event.text)
                    deltas.append(
                        ChatDelta(tool_calls=[ToolCallDelta(index=event.index, function=function)])
                    )
        return deltas
