"""Loading a tokenizer directory: ids, special tokens, EOS ids, errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hipfire_serve.tokenizer import Tokenizer

TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40)


def test_loads_ids_and_eos(byte_level_dir):
    tok = Tokenizer.from_dir(byte_level_dir)
    assert tok.vocab_size == 420
    # generation_config [2, 0], config.json 2, tokenizer_config eos <|im_end|> (id 2): deduplicated
    assert tok.eos_token_ids == (2, 0)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.id_to_piece(1) == "<|im_start|>"
    assert tok.is_special(2) and not tok.is_special(100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_piece(10_000)


def test_added_token_dicts_and_bos(byte_fallback_dir):
    tok = Tokenizer.from_dir(byte_fallback_dir)
    assert tok.bos_token == "<s>" and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids[1:] == tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


@given(TEXT)
def test_round_trip_byte_level(byte_level_dir, text):
    tok = _cached(byte_level_dir)
    assert tok.decode(tok.encode(text)) == text


@given(TEXT)
def test_round_trip_byte_fallback(byte_fallback_dir, text):
    tok = _cached(byte_fallback_dir)
    # The normalizer prepends "▁" and the decoder strips it again, as SentencePiece does.
    assert tok.decode(tok.encode(text)) == text


_CACHE: dict = {}


def _cached(path) -> Tokenizer:
    if path not in _CACHE:
        _CACHE[path] = Tokenizer.from_dir(path)
    return _CACHE[path]


def test_missing_files_name_the_file(tmp_path, byte_level_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer\.json .* could not be loaded") as e:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad_cfg"
    bad.mkdir()
    (bad / "tokenizer.json").write_text((byte_level_dir / "tokenizer.json").read_text())
    (bad / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json .* not valid JSON"):
        Tokenizer.from_dir(bad)


def test_optional_files_absent(tmp_path, byte_level_dir):
    (tmp_path / "tokenizer.json").write_text((byte_level_dir / "tokenizer.json").read_text())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == ()
    assert not tok.has_chat_template
    assert tok.encode("hi there") == tok.encode("hi there", add_special_tokens=False)


def test_add_bos_false_drops_post_processor_bos(tmp_path, byte_fallback_dir):
    data = json.loads((byte_fallback_dir / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": False})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello")[0] != 1
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": True})
    )
    ids = Tokenizer.from_dir(tmp_path).encode("hello")
    assert ids[0] == 1 and ids[1] != 1  # the post-processor's BOS, not a second one
