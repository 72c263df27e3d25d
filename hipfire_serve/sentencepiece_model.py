"""SentencePiece models (`tokenizer.model` without a `tokenizer.json`): the protobuf read
directly (no `sentencepiece` or `protobuf` package at run time) and turned into the `tokenizers`
pipeline Hugging Face converts such models to (Unigram or BPE, byte fallback, user-defined
pieces)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer as _HFTokenizer

# SentencePiece piece types (sentencepiece_model.proto)
_SPM_NORMAL, _SPM_UNKNOWN, _SPM_CONTROL, _SPM_USER_DEFINED = 1, 2, 3, 4
_SPM_UNIGRAM, _SPM_BPE = 1, 2
_SPM_SPACE = "\u2581"  # the piece alphabet's space, "▁"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _proto_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as ints (int32 sign restored),
    fixed-width and length-delimited fields as their bytes."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(data, i)
            value = value - (1 << 64) if value >= 1 << 63 else value
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, i = data[i : i + width], i + width
        elif wire == 2:
            length, i = _varint(data, i)
            value, i = data[i : i + length], i + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, value


@dataclass
class SentencePieceModel:
    """The parts of a SentencePiece `ModelProto` that tokenization needs (defaults as in the
    proto). Read with the wire format directly, so loading needs no protobuf library."""

    pieces: list[tuple[str, float, int]]  # (piece, score, type) by id
    model_type: int = _SPM_UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    @classmethod
    def parse(cls, data: bytes) -> SentencePieceModel:
        model = cls(pieces=[])
        trainer = {3: "model_type", 35: "byte_fallback", 40: "unk_id", 41: "bos_id"}
        trainer |= {42: "eos_id", 43: "pad_id"}
        normalizer = {2: "precompiled_charsmap", 3: "add_dummy_prefix"}
        normalizer |= {4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
        for number, value in _proto_fields(data):
            if number == 1:  # SentencePiece {piece = 1, score = 2, type = 3}
                piece = {1: b"", 2: b"\0\0\0\0", 3: _SPM_NORMAL} | dict(_proto_fields(value))
                score = struct.unpack("<f", piece[2])[0]
                model.pieces.append((piece[1].decode("utf-8"), score, piece[3]))
            elif number in (2, 3):  # TrainerSpec, NormalizerSpec
                names = trainer if number == 2 else normalizer
                for inner, inner_value in _proto_fields(value):
                    if inner in names:
                        name = names[inner]
                        kind = type(getattr(model, name))
                        setattr(model, name, inner_value if kind is bytes else kind(inner_value))
        return model

    def piece(self, piece_id: int) -> str | None:
        return self.pieces[piece_id][0] if 0 <= piece_id < len(self.pieces) else None

    def to_hf(self, legacy: bool = True) -> _HFTokenizer:
        """The equivalent `tokenizers` pipeline, as Hugging Face converts such a model: text
        between special tokens encodes as `SentencePieceProcessor.encode` would. `legacy`
        (tokenizer_config.json's, on by default there too) puts the dummy prefix before every
        such stretch instead of only the first."""
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

        user_defined = [p for p, _, t in self.pieces if t == _SPM_USER_DEFINED]
        if self.model_type == _SPM_UNIGRAM:
            vocab = [(p, s) for p, s, _ in self.pieces]
            model = models.Unigram(vocab, self.unk_id, self.byte_fallback)
        elif self.model_type == _SPM_BPE:
            ids = {p: i for i, (p, _, _) in enumerate(self.pieces)}
            model = models.BPE(
                ids,
                self._bpe_merges(),
                unk_token=self.piece(self.unk_id),
                fuse_unk=True,
                byte_fallback=self.byte_fallback,
                # user-defined pieces come whole, never merged
                ignore_merges=bool(user_defined),
            )
        else:
            raise ValueError(
                f"SentencePiece model type {self.model_type} (word/char) is not supported"
            )
        hf = _HFTokenizer(model)
        steps = (
            [normalizers.Precompiled(self.precompiled_charsmap)]
            if self.precompiled_charsmap
            else []
        )
        if self.remove_extra_whitespaces:
            # only spaces: SentencePiece leaves newlines and tabs alone
            steps += [
                normalizers.Replace(Regex(r"\A +| +\z"), ""),
                normalizers.Replace(Regex(" {2,}"), " "),
            ]
        if self.escape_whitespaces:
            steps.append(normalizers.Replace(" ", _SPM_SPACE))
        if self.add_dummy_prefix and legacy:
            # Metaspace adds no prefix to a text already starting with "▁"; SentencePiece does
            steps.append(normalizers.Replace(Regex(f"\\A{_SPM_SPACE}"), _SPM_SPACE * 2))
        hf.normalizer = normalizers.Sequence(steps)
        splits = []
        if self.add_dummy_prefix:
            scheme = "always" if legacy else "first"
            splits.append(pre_tokenizers.Metaspace(_SPM_SPACE, prepend_scheme=scheme, split=False))
        if user_defined:
            longest_first = sorted(user_defined, key=len, reverse=True)
            pattern = Regex("|".join(re.escape(p) for p in longest_first))
            splits.append(pre_tokenizers.Split(pattern, behavior="isolated"))
        if splits:
            hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
        steps = [decoders.Replace(_SPM_SPACE, " ")]
        if self.byte_fallback:
            steps.append(decoders.ByteFallback())
        steps.append(decoders.Fuse())
        if self.add_dummy_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        hf.decoder = decoders.Sequence(steps)
        # control and unknown pieces are special: matched in text, dropped by skip_special_tokens
        special = [p for p, _, t in self.pieces if t in (_SPM_UNKNOWN, _SPM_CONTROL)]
        hf.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
        return hf

    def _bpe_merges(self) -> list[tuple[str, str]]:
        """Merges of a BPE model, which stores only scored pieces: every split of a normal piece
        into two normal pieces, the higher-scored (then lower-id) merged pieces first."""
        normal = {p: (s, i) for i, (p, s, t) in enumerate(self.pieces) if t == _SPM_NORMAL}
        ranked = []
        for piece, (score, piece_id) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, piece_id, left, right))
        ranked.sort()
        return [(left, right) for _, _, left, right in ranked]
