"""The SSE parser on streams cut at arbitrary byte boundaries."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from loadtests.sse import SSEParser

STREAM = (
    ": keep-alive\r\n\r\n"
    'data: {"text": "héllo"}\r\n\r\n'
    "event: ping\ndata: a\ndata: b\n\n"
    'data:{"text": "日本"}\r\rdata: [DONE]\n\n'
).encode()


def parse_all(pieces):
    parser = SSEParser()
    events = [e for p in pieces for e in parser.feed(p)]
    return events + parser.close()


def test_whole_stream():
    events = parse_all([STREAM])
    assert [(e.event, e.data) for e in events] == [
        ("message", '{"text": "héllo"}'),
        ("ping", "a\nb"),
        ("message", '{"text": "日本"}'),
        ("message", "[DONE]"),
    ]


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_gives_the_same_events(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert parse_all(pieces) == parse_all([STREAM])


def test_final_event_without_blank_line():
    assert [e.data for e in parse_all([b"data: x\n\ndata: tail"])] == ["x", "tail"]
