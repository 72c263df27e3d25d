"""Tool-call parser events, the parser interface and the registry of parsers by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's position among this choice's calls
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    index: int
    text: str  # the next characters of the call's arguments (JSON text)


ToolEvent = Content | CallStart | CallArgs


class ToolParser:
    """One choice's parser; `feed` each text delta in order, then `finish` once."""

    def feed(self, text: str) -> list[ToolEvent]:
        raise NotImplementedError

    def finish(self) -> list[ToolEvent]:
        """The events of text held back until the output's end (a partial tag, say)."""
        return []


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: serves the parser as `--tool-call-parser NAME`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    cls = _PARSERS.get(name)
    if cls is None:
        known = ", ".join(sorted(_PARSERS))
        raise ValueError(f"--tool-call-parser {name!r} is not known (known: {known})")
    return cls


def tool_parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))
