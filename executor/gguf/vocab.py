"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`, with its special tokens and chat template.

GGUF stores a byte-level BPE ('gpt2' model) as the vocabulary in byte-level form, the merges as
"left right" strings and a pre-tokenizer name (`tokenizer.ggml.pre`) that stands for the split
regex of the model family; the tokenizer is rebuilt from those: that regex, byte-level mapping,
BPE, byte-level decoding. Control tokens become special added tokens, user-defined ones plain
added tokens. SentencePiece vocabularies ('llama' model) and unknown pre-tokenizers are refused
with a one-line reason (a tokenizer.json beside the file is used instead, when there is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from executor.gguf.files import GGUFMetadata
from executor.model_config import ModelLoadError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, merges ignored for words already in the vocabulary,
# NFC normalisation), as the model families' own tokenizer.json files have them
PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "default": (_GPT2, False, False),
    "gpt-2": (_GPT2, False, False),
    "llama-bpe": (_LLAMA3, True, False),
    "llama3": (_LLAMA3, True, False),
    "qwen2": (_QWEN2, False, True),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass(frozen=True)
class GGUFVocab:
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | dict[str, str] | None
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool | None
    eos_token_ids: tuple[int, ...]


def _bpe_tokenizer(tokens: list[str], types: list[int], merges: list[str], pre: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
    from tokenizers import pre_tokenizers as pt

    pattern, ignore_merges, nfc = PRE_TOKENIZERS[pre]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pt.Sequence(
        [
            pt.Split(Regex(pattern), behavior="isolated"),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=kind == CONTROL, normalized=False)
        for i, kind in enumerate(types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def _chat_template(meta: GGUFMetadata) -> str | dict[str, str] | None:
    default = meta.get("tokenizer.chat_template")
    names = meta.get("tokenizer.chat_templates") or []
    if not names:
        return default
    named = {n: meta.get(f"tokenizer.chat_template.{n}") for n in names}
    if default:
        named["default"] = default
    return {n: t for n, t in named.items() if t}


def read_gguf_vocab(path: Path) -> GGUFVocab:
    """The file's tokenizer; ModelLoadError (one line) for a vocabulary it cannot rebuild."""
    meta = GGUFMetadata(Path(path))
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        what = "SentencePiece " if model == "llama" else ""
        raise ModelLoadError(
            f"{meta.path.name}: GGUF tokenizer model {model!r} ({what}vocabulary) is not "
            "supported (only byte-level BPE, 'gpt2'); put the model's tokenizer.json beside the "
            "file and name the directory"
        )
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{meta.path.name}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges") or []
    tokenizer = _bpe_tokenizer(tokens, types, merges, pre)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    eos_ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return GGUFVocab(
        tokenizer=tokenizer,
        chat_template=_chat_template(meta),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=bool(add_bos) if add_bos is not None else None,
        eos_token_ids=tuple(int(i) for i in eos_ids if i is not None),
    )
