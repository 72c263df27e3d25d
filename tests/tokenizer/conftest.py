"""Tiny tokenizers built in the test run: a byte-level BPE (GPT-2/Qwen style) and a Metaspace
BPE with byte fallback (Llama/SentencePiece style), each saved as a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

SENTENCES = [
    "Hello world, this is a small test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus München! Ça va très bien, merci.",
    "日本語のテキストです。東京は大きい。",
    "Привет, мир! Как дела?",
    "emoji party 🎉🚀 with friends 👩‍💻",
    "def main():\n    return 42\n",
]
ASCII_SENTENCES = [s for s in SENTENCES if s.isascii()] + ["cafe and tea, 12 + 30 = 42"]

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]


def _write_dir(root: Path, tok: HFTokenizer, files: dict[str, dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    for name, data in files.items():
        (root / name).write_text(json.dumps(data), encoding="utf-8")
    return root


def build_byte_level() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


def build_byte_fallback() -> HFTokenizer:
    """Trained on ASCII text only, so every other character falls back to <0xNN> byte pieces."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=LLAMA_SPECIALS, show_progress=False
    )
    tok.train_from_iterator(ASCII_SENTENCES * 4, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return HFTokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory) -> Path:
    return _write_dir(
        tmp_path_factory.mktemp("byte_level"),
        build_byte_level(),
        {
            "tokenizer_config.json": {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "add_bos_token": False,
            },
            "generation_config.json": {"eos_token_id": [2, 0]},
            "config.json": {"eos_token_id": 2, "vocab_size": 512},
        },
    )


@pytest.fixture(scope="session")
def byte_fallback_dir(tmp_path_factory) -> Path:
    return _write_dir(
        tmp_path_factory.mktemp("byte_fallback"),
        build_byte_fallback(),
        {
            "tokenizer_config.json": {
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": {"content": "</s>", "special": True},
                "unk_token": "<unk>",
                "add_bos_token": True,
            },
            "config.json": {"eos_token_id": 2},
        },
    )
