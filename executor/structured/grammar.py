"""Grammars of structured outputs in llguidance's terms, and their compilation for one tokenizer.

`grammar_text` turns a `GrammarSpec` into an llguidance grammar; `GrammarCompiler` builds the
matcher of a grammar over the model's vocabulary once per distinct spec (an LRU of compiled
templates) and hands each request a copy. llguidance builds its lexer and parser lazily, so a
compile is about a millisecond for an ordinary JSON schema and a bad one fails there, before the
request is admitted. JSON is generated with fixed separators (", " and ": ") and no free
whitespace, so a model cannot spend its tokens on blank space inside a value.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from scheduler.plan import GrammarSpec

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (a template each; requests get copies)
# the library's threads for a round's masks: a couple of cores; the engine's own thread and the
# device's launches need the rest
MASK_THREADS = 2


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message is the library's reason."""


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (GrammarError when its source is malformed)."""
    matcher = llguidance.LLMatcher
    try:
        if spec.kind == "json":
            return matcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choices must be a list of strings")
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":  # Lark, or GBNF converted to Lark
            return llguidance.grammar_from("grammar", spec.source)
    except GrammarError:
        raise
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(GRAMMAR_KINDS)})")


class GrammarCompiler:
    """Compiled grammars over one vocabulary, and the masks of their matchers. The tokenizer's
    vocabulary is as wide as the model's logits (tokens past the tokenizer's are never
    allowed); its end-of-sequence tokens end a completed grammar, and only a completed one.
    Used from the engine's thread only."""

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eos_token_ids = tuple(tokenizer.eos_tokens)
        self._templates: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def from_tokenizer_json(
        cls, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler:
        """From a `tokenizer.json` text; `vocab_size` is the width of the model's logits."""
        tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        return cls(tokenizer)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled template of `spec` (cached); GrammarError naming the library's reason."""
        template = self._templates.get(spec)
        if template is not None:
            self._templates.move_to_end(spec)
            return template
        template = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        self._templates[spec] = template
        if len(self._templates) > CACHE_SIZE:
            self._templates.popitem(last=False)
        return template

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher of `spec` at the start of the output, for one request."""
        return self.compile(spec).deep_copy()

    def fill_masks(self, plain: list, drafted: list, bitmask: np.ndarray) -> None:
        """Fills rows of `bitmask` [rows, W] int32 in one pass of the library's threads, without
        the GIL. `plain`: (matcher, row) for the next token; `drafted`: (matcher, row, drafts)
        for row .. row + len(drafts), each after the drafts before it, stopping after a draft
        the grammar refuses or one that completes it (the rows after keep what they hold). The
        matchers' states are left as they were."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(MASK_THREADS)
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, drafted, bitmask
            )


def compiler_for(
    tokenizer_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
) -> tuple[GrammarCompiler | None, str]:
    """(the compiler of a model directory's `tokenizer.json`, "") or (None, why not)."""
    if not eos_token_ids:
        return None, "the tokenizer names no end-of-sequence token"
    try:
        text = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
        return GrammarCompiler.from_tokenizer_json(text, vocab_size, eos_token_ids), ""
    except Exception as exc:  # OSError, or whatever the library raises for this tokenizer
        return None, f"the grammar library cannot read the tokenizer ({exc})"
