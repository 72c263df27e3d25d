"""A tokenizer directory with only a SentencePiece `tokenizer.model`: loaded into the same
`tokenizers` pipeline Hugging Face converts such models to. The hand-made model's outputs are
worked out by hand; models trained by the sentencepiece library (where it is installed) must
encode and decode exactly as `SentencePieceProcessor` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hipfire_serve.sentencepiece_model import SentencePieceModel
from hipfire_serve.tokenizer import Tokenizer
from tests.server.sentencepiece_models import SPACE, piece_id, unigram_model_bytes

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Grüße aus Köln, naïve café and 東京.",
    "for i in range(10): print(i * i)",
    "Hello world, hello there, HELLO!",
]
TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces",
    "trailing ",
    "new\nline\n\n x",
    "tab\there",
    "東京 and 🚀 emoji",
    "Grüße",
    "quick<sep>fox",
    "ﬁ ligature ①",
    "unseen zqxj",
    f"{SPACE}already",
]


def _dir(tmp_path: Path, model: bytes, config: dict | None = None) -> Path:
    (tmp_path / "tokenizer.model").write_bytes(model)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_hand_made_model(tmp_path):
    tok = Tokenizer.from_dir(_dir(tmp_path, unigram_model_bytes(300)))
    assert tok.vocab_size == 300 and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    words = [piece_id(SPACE + "the"), piece_id(SPACE + "quick"), piece_id(SPACE + "fox")]
    assert tok.encode("the quick fox") == [tok.bos_token_id, *words]  # BOS by default
    assert tok.encode("the  quick fox ", add_special_tokens=False) == words
    # characters outside the pieces fall back to their UTF-8 bytes
    hi = tok.encode("Hi", add_special_tokens=False)
    assert [tok.id_to_piece(i) for i in hi] == [SPACE, "<0x48>", "i"]
    for text in ("Hi, Köln!", "a\nb", "東京 🚀", "hello world"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.is_special(tok.bos_token_id) and not tok.is_special(hi[1])
    assert tok.encode("<s>the", add_special_tokens=False) == [tok.bos_token_id, words[0]]


def test_config_tokens_past_the_pieces(tmp_path):
    added = {"300": {"content": "<|im_start|>", "special": True}}
    config = {"add_bos_token": False, "added_tokens_decoder": added}
    tok = Tokenizer.from_dir(_dir(tmp_path, unigram_model_bytes(300), config))
    assert tok.encode("<|im_start|>the") == [300, piece_id(SPACE + "the")]
    assert tok.is_special(300) and tok.vocab_size == 301
    skipped = {"302": {"content": "<|gap|>", "special": True}}
    with pytest.raises(ValueError, match="past the vocabulary"):
        Tokenizer.from_dir(
            _dir(tmp_path, unigram_model_bytes(300), {"added_tokens_decoder": skipped})
        )


def test_missing_or_broken_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.model"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.model .* could not be loaded"):
        Tokenizer.from_dir(_dir(tmp_path, b"\x0f not a protobuf"))


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
@pytest.mark.parametrize("byte_fallback", [True, False])
def test_trained_models_match_sentencepiece(tmp_path, model_type, byte_fallback):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS * 30))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "tokenizer"),
        model_type=model_type,
        vocab_size=400 if byte_fallback else 150,
        hard_vocab_limit=False,
        byte_fallback=byte_fallback,
        user_defined_symbols=["<sep>"],
        character_coverage=1.0,
        minloglevel=2,
    )
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    model = SentencePieceModel.parse((tmp_path / "tokenizer.model").read_bytes())
    assert len(model.pieces) == reference.get_piece_size()
    assert model.byte_fallback == byte_fallback and model.precompiled_charsmap
    tok = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        ids = reference.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        if reference.unk_id() not in ids:  # SentencePiece shows an unknown piece as " ⁇ "
            assert tok.decode(ids) == reference.decode(ids), text
    assert tok.encode("hi")[0] == reference.bos_id()
