"""SentencePiece `tokenizer.model` files made offline, without the sentencepiece library.

`unigram_model_bytes` writes a `ModelProto` in protobuf's wire format: a Unigram model with
byte fallback whose pieces are the special ones, the 256 byte pieces, "▁", the lowercase
letters and a few whole words, so what text encodes to can be worked out by hand (unused
pieces pad it to a model's vocabulary). `spm_model_dir` turns a tiny checkpoint into one that
ships only that `tokenizer.model`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SPACE = "\u2581"
WORDS = ("hello", "world", "the", "quick", "brown", "fox")
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32s take ten bytes, as protobuf writes them
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | float | bytes | str) -> bytes:
    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def pieces(vocab_size: int = 0) -> list[tuple[str, float, int]]:
    """(piece, score, type) by id, `vocab_size` of them at least."""
    out = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    out += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    out += [(SPACE, -2.0, NORMAL)]
    out += [(chr(c), -3.0, NORMAL) for c in range(ord("a"), ord("z") + 1)]
    out += [(SPACE + word, -1.0, NORMAL) for word in WORDS]
    return out + [(f"<unused{i}>", 0.0, UNUSED) for i in range(vocab_size - len(out))]


def unigram_model_bytes(vocab_size: int = 0) -> bytes:
    model = b"".join(
        _field(1, _field(1, piece) + _field(2, score) + _field(3, kind))
        for piece, score, kind in pieces(vocab_size)
    )
    trainer = _field(3, 1) + _field(35, 1) + _field(40, 0) + _field(41, 1) + _field(42, 2)
    trainer += _field(43, -1) + _field(2, "tiny")  # pad_id -1; model_prefix, unread
    normalizer = _field(1, "identity") + _field(3, 1) + _field(4, 1) + _field(5, 1)
    return model + _field(2, trainer) + _field(3, normalizer)


def piece_id(piece: str) -> int:
    return next(i for i, (p, _, _) in enumerate(pieces()) if p == piece)


def spm_model_dir(model_dir: Path) -> Path:
    """`model_dir` (a tiny checkpoint) with `tokenizer.model` in place of `tokenizer.json` and
    the config naming its special pieces; returns `model_dir`."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.model").write_bytes(unigram_model_bytes(vocab_size))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "legacy": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir
