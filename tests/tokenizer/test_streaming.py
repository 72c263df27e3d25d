"""Streaming text: incremental detokenization and stop strings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from hipfire_serve.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    OutputStream,
    StopStringMatcher,
    Tokenizer,
)

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
# Short texts over few letters so stop strings actually occur.
SMALL_TEXT = st.text(alphabet="abc é🎉", max_size=30)


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request) -> Tokenizer:
    return Tokenizer.from_dir(request.getfixturevalue(f"{request.param}_dir"))


@pytest.fixture(scope="module")
def byte_level(byte_level_dir) -> Tokenizer:
    return Tokenizer.from_dir(byte_level_dir)


def split_points(draw, n: int) -> list[list[int]]:
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    bounds = [0, *cuts, n]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def chunked(draw, ids: list[int]) -> list[list[int]]:
    return [[ids[i] for i in chunk] for chunk in split_points(draw, len(ids))]


def text_with_specials(draw, tokenizer: Tokenizer) -> list[int]:
    """Encoded text pieces with special tokens between them (a model emits a special token
    between characters, not inside one)."""
    specials = sorted(i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i))
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        ids += tokenizer.encode(draw(TEXT), add_special_tokens=False)
        ids += draw(st.lists(st.sampled_from(specials), max_size=2))
    return ids


@given(data=st.data(), skip_special=st.booleans())
def test_incremental_equals_full_decode(tok, data, skip_special):
    """Multi-byte characters split over byte-level and <0xNN> tokens, special tokens between."""
    ids = text_with_specials(data.draw, tok)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
    shown = ""
    for chunk in chunked(data.draw, ids):
        delta = detok.push(chunk)
        assert not delta.endswith(REPLACEMENT_CHAR)
        shown += delta
        assert tok.decode(ids, skip_special).startswith(shown)
    shown += detok.finish()
    assert shown == detok.text == tok.decode(ids, skip_special)
    assert detok.token_ids == ids


@given(data=st.data(), prompt=TEXT, text=TEXT)
def test_prompt_context_keeps_spacing(tok, data, prompt, text):
    """Output after a prompt reads as the tail of decode(prompt + output): spaces at the boundary
    are not lost (Metaspace strips a leading space only at the start of the whole text)."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(" " + text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    shown = "".join(detok.push(chunk) for chunk in chunked(data.draw, ids)) + detok.finish()
    prompt_text = tok.decode(prompt_ids)
    full = tok.decode(prompt_ids + ids)
    assume(full.startswith(prompt_text))
    assert shown == full[len(prompt_text) :]


@given(data=st.data())
def test_arbitrary_byte_level_ids(byte_level, data):
    """Random ids (invalid UTF-8 included): deltas never end inside a character and join to the
    full decode once finished."""
    ids = data.draw(st.lists(st.integers(0, byte_level.vocab_size - 1), max_size=30))
    detok = IncrementalDetokenizer(byte_level)
    shown = ""
    for chunk in chunked(data.draw, ids):
        delta = detok.push(chunk)
        assert not delta.endswith(REPLACEMENT_CHAR)
        shown += delta
    assert shown + detok.finish() == byte_level.decode(ids)


def test_holds_incomplete_character(byte_level):
    ids = byte_level.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is not one token in this vocabulary
    detok = IncrementalDetokenizer(byte_level)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    start, stop = best
    return text[: start + len(stop) if include else start], stop


@given(
    data=st.data(),
    text=SMALL_TEXT,
    stops=st.lists(st.text(alphabet="abc é🎉", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_matcher_across_deltas(data, text, stops, include):
    matcher = StopStringMatcher(stops, include)
    expected, expected_stop = reference_cut(text, stops, include)
    shown = ""
    hit = None
    for chunk in split_points(data.draw, len(text)):
        match = matcher.push("".join(text[i] for i in chunk))
        shown += match.text
        # Never shows text that the final output will not have (e.g. half a stop string).
        assert expected.startswith(shown)
        if match.stop is not None:
            hit = match.stop
            break
    if hit is None:
        shown += matcher.flush()
    assert (shown, hit) == (expected, expected_stop)


@given(
    data=st.data(),
    text=SMALL_TEXT,
    stop=st.text(alphabet="abc é🎉", min_size=1, max_size=3),
    include=st.booleans(),
)
def test_output_stream_keeps_ids_up_to_the_stop(tok, data, text, stop, include):
    ids = tok.encode(text, add_special_tokens=False)
    stream = OutputStream(tok, stop_strings=[stop], include_stop_str_in_output=include)
    pushed: list[int] = []
    result = None
    for chunk in chunked(data.draw, ids):
        step = stream.push(chunk)
        pushed += chunk[: step.num_kept_ids]
        if step.stop is not None:
            result = step
            break
        assert step.num_kept_ids == len(chunk)
    if result is None:
        result = stream.finish()
    full = tok.decode(ids)
    expected, expected_stop = reference_cut(full, [stop], include)
    assert stream.text == expected and result.stop == expected_stop
    if expected_stop is not None:
        # The stop completes inside the last kept token, not before it.
        assert stop in tok.decode(pushed) and stop not in tok.decode(pushed[:-1])
    assert stream.push(ids[:1]).num_kept_ids == (0 if expected_stop else len(ids[:1]))


def test_output_stream_without_stops_and_finish_tail(byte_level):
    ids = byte_level.encode("ab🎉", add_special_tokens=False)
    stream = OutputStream(byte_level)
    step = stream.push(ids[:-1])
    assert step.num_kept_ids == len(ids) - 1 and step.stop is None
    assert stream.finish().text.endswith(REPLACEMENT_CHAR)  # the cut-off emoji shows as U+FFFD
    stops = OutputStream(byte_level, stop_strings=["b🎉"])
    stops.push(ids[:-1])
    assert stops.text == "a"  # "b" and the partial emoji are held back
    assert stops.finish().text == "b" + REPLACEMENT_CHAR
