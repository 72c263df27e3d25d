"""Tokenization for the engine: a Hugging Face tokenizer directory, chat templates, streaming
detokenization and stop strings.

- `Tokenizer` wraps `tokenizer.json` (the `tokenizers` library), or a SentencePiece
  `tokenizer.model` turned into the same pipeline (`SentencePieceModel`), plus the bits of
  `tokenizer_config.json`, `generation_config.json` and `config.json` the engine needs.
- `IncrementalDetokenizer` turns a growing list of token ids into text deltas.
- `StopStringMatcher` finds stop strings in a stream of text deltas.
- `OutputStream` joins the two for one request: `push(ids) -> StreamStep`, called once per round.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from hipfire_serve.sentencepiece_model import SentencePieceModel

REPLACEMENT_CHAR = "\ufffd"
# Tokens before the end of the prompt that seed the detokenizer's decode window, so that the first
# output token is decoded with its left context (leading-space handling of e.g. Metaspace).
PROMPT_CONTEXT_TOKENS = 5
# Inputs from this size on go through the `tokenizers` batch calls, which release the GIL while
# they work (the single-input calls hold it: seconds for a prompt of a few MiB), so a worker
# thread tokenizing a long prompt leaves the event loop and the engine thread running.
GIL_FREE_MIN_CHARS = 4096
GIL_FREE_MIN_IDS = 1024


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} in {path.parent} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} in {path.parent} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    templates; for serving only its body matters."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a chat template in a sandbox with the helpers Hugging Face templates call."""
    return _chat_template_env().from_string(source)


def _add_config_tokens(hf: _HFTokenizer, added: Any) -> None:
    """tokenizer_config.json's `added_tokens_decoder` on a tokenizer built from a SentencePiece
    model: tokens past its pieces (chat markers of a fine-tune) at their ids, and the special
    flag of pieces it already has."""
    if not isinstance(added, Mapping):
        return
    from tokenizers import AddedToken

    for key in sorted(added, key=lambda k: int(k) if str(k).isdigit() else -1):
        entry = added[key]
        if not (str(key).isdigit() and isinstance(entry, Mapping)):
            continue
        content, token_id = _token_content(entry), int(key)
        if content is None:
            continue
        special = bool(entry.get("special", False))
        token = AddedToken(content, special=special, normalized=bool(entry.get("normalized")))
        if token_id < hf.get_vocab_size(with_added_tokens=True):
            if hf.token_to_id(content) != token_id:
                raise ValueError(f"added token {content!r} has id {token_id}, the model another")
            if special:
                hf.add_special_tokens([token])
        elif token_id == hf.get_vocab_size(with_added_tokens=True):
            (hf.add_special_tokens if special else hf.add_tokens)([token])
        else:
            raise ValueError(f"added token {content!r} has id {token_id}, past the vocabulary")


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens, EOS ids and the chat template."""

    def __init__(
        self,
        hf: _HFTokenizer,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._hf = hf
        self._templates: dict[str | None, jinja2.Template] = {}
        if isinstance(chat_template, Mapping):
            self._template_sources: dict[str | None, str] = dict(chat_template)
            if "default" in self._template_sources:
                self._template_sources[None] = self._template_sources["default"]
        else:
            self._template_sources = {None: chat_template} if chat_template else {}
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = self._id_of(bos_token)
        self.add_bos_token = add_bos_token
        ids = list(eos_token_ids)
        eos_id = self._id_of(eos_token)
        if eos_id is not None:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        """The tokenizer and chat template a GGUF file's metadata carries."""
        from executor.gguf.vocab import read_gguf_vocab

        v = read_gguf_vocab(path)
        return cls(
            v.tokenizer,
            chat_template=v.chat_template,
            bos_token=v.bos_token,
            eos_token=v.eos_token,
            unk_token=v.unk_token,
            pad_token=v.pad_token,
            add_bos_token=v.add_bos_token,
            eos_token_ids=v.eos_token_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads `tokenizer.json` (or else a SentencePiece `tokenizer.model`) and, when present,
        `tokenizer_config.json`, `chat_template.jinja` / `chat_template.json`,
        `generation_config.json` and `config.json`. A `.gguf` file, or a directory holding
        one and no tokenizer files, gives the tokenizer of its metadata."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file() and not (root / "tokenizer.model").is_file():
            from executor.gguf.files import find_gguf_file

            gguf_file = find_gguf_file(root)
            if gguf_file is not None:
                return cls._from_gguf(gguf_file)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {root}")
        cfg_file = root / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            tok_file = root / "tokenizer.model"
            if not tok_file.is_file():
                raise FileNotFoundError(
                    f"tokenizer.json not found in {root} (nor a SentencePiece tokenizer.model)"
                )
        spm: SentencePieceModel | None = None
        try:
            if tok_file.name == "tokenizer.json":
                hf = _HFTokenizer.from_file(str(tok_file))
            else:
                spm = SentencePieceModel.parse(tok_file.read_bytes())
                hf = spm.to_hf(legacy=cfg.get("legacy") is not False)
                _add_config_tokens(hf, cfg.get("added_tokens_decoder"))
        except Exception as e:  # the Rust error text is long; keep the first line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{tok_file.name} in {root} could not be loaded: {first}") from None
        template: str | dict[str, str] | None = None
        raw_template = cfg.get("chat_template")
        if isinstance(raw_template, list):
            template = {
                t["name"]: t["template"]
                for t in raw_template
                if isinstance(t, Mapping) and isinstance(t.get("template"), str)
            }
        elif isinstance(raw_template, str):
            template = raw_template
        # Newer checkpoints keep the template in its own file, which then takes precedence.
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif (root / "chat_template.json").is_file():
            tpl = _read_json(root / "chat_template.json").get("chat_template")
            if isinstance(tpl, str):
                template = tpl

        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                eos_ids += _as_id_list(_read_json(root / name).get("eos_token_id"))
        add_bos = cfg.get("add_bos_token")
        # A SentencePiece model names its own special pieces; it adds BOS unless told otherwise,
        # as Hugging Face's Llama tokenizer does.
        own = {}
        if spm is not None:
            own = {
                f"{name}_token": spm.piece(getattr(spm, f"{name}_id"))
                for name in ("bos", "eos", "unk", "pad")
            }
            if add_bos is None:
                add_bos = own["bos_token"] is not None
        return cls(
            hf,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token", own.get("bos_token"))),
            eos_token=_token_content(cfg.get("eos_token", own.get("eos_token"))),
            unk_token=_token_content(cfg.get("unk_token", own.get("unk_token"))),
            pad_token=_token_content(cfg.get("pad_token", own.get("pad_token"))),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            eos_token_ids=eos_ids,
        )

    # -- ids and text ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer can produce, added tokens included (the model's embedding may
        be padded beyond this)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_sources)

    def with_chat_template(self, source: str) -> Tokenizer:
        """A copy that renders every chat with `source` instead of the model's template(s);
        ValueError when it does not compile."""
        try:
            compiled = compile_chat_template(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e.message}") from None
        other = copy.copy(self)
        other._template_sources = {None: source}
        other._templates = {None: compiled}
        return other

    def chat_template_variables(self, template_name: str | None = None) -> frozenset[str]:
        """The variables the chat template reads from its context (empty without one)."""
        source = self._template_sources.get(template_name)
        if not source:
            return frozenset()
        try:
            parsed = _chat_template_env().parse(source)
        except jinja2.exceptions.TemplateSyntaxError:
            return frozenset()
        return frozenset(jinja2.meta.find_undeclared_variables(parsed))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._hf.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` (the raw piece, e.g. 'Ġhello' or '<0x0A>')."""
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        return piece

    def is_special(self, token_id: int) -> bool:
        """True for added tokens marked special (those `skip_special_tokens` drops)."""
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor runs, and
        `add_bos_token` from tokenizer_config.json is honoured on top of it. Text rendered by
        `apply_chat_template` already carries its special tokens: encode it with False."""
        ids = self._encode_ids(text, add_special_tokens)
        if not add_special_tokens or self.bos_token_id is None or self.add_bos_token is None:
            return ids
        bos = self.bos_token_id
        if self.add_bos_token and (not ids or ids[0] != bos):
            return [bos, *ids]
        if not self.add_bos_token and ids and ids[0] == bos:
            plain = self._encode_ids(text, False)
            if not plain or plain[0] != bos:  # the post-processor added it: drop it
                return ids[1:]
        return ids

    def _encode_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < GIL_FREE_MIN_CHARS:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        # The fast batch call also skips the character offsets, whose teardown alone holds
        # the GIL for a while on a long text.
        encode_batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) < GIL_FREE_MIN_IDS:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        template_name: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Renders `messages` with the model's chat template. Raises ValueError when the model has
        no template or the template rejects the conversation."""
        if not self._template_sources:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json or "
                "chat_template.jinja); use the completions API with a plain prompt"
            )
        if template_name is not None and template_name not in self._template_sources:
            raise ValueError(
                f"no chat template named {template_name!r}; "
                f"have {sorted(k for k in self._template_sources if k is not None)}"
            )
        if template_name is None and None not in self._template_sources:
            raise ValueError("this model has named chat templates but no 'default' one")
        template = self._templates.get(template_name)
        if template is None:
            try:
                template = compile_chat_template(self._template_sources[template_name])
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"the chat template does not compile: {e.message}") from None
            self._templates[template_name] = template
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
            **template_kwargs,
        }
        try:
            return template.render(
                messages=list(messages),
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e.message or e}") from None


# -- streaming -----------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Text deltas of a growing output, each one safe to show.

    Each push decodes a small window `ids[prefix_offset:]` and compares it with the decode of
    `ids[prefix_offset:read_offset]`, text already shown; the difference is new. Decoding with a
    few tokens of left context keeps spacing right where a decoder treats the first token of a
    string differently (e.g. SentencePiece's leading-space strip). A window whose text ends in
    U+FFFD ended inside a multi-byte character: the complete characters before it are shown,
    the offsets stay, and a later token completes the character. `finish()` releases the rest.

    The deltas join to `decode(output_ids)` when the output is valid UTF-8; with invalid byte
    sequences the replacement characters may be grouped differently at window edges.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids or ())[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context  # decode window source: prompt context + outputs
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_shown_past_read = 0  # chars shown beyond the read offset's text, while holding
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Output token ids pushed so far."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._text_parts)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip_special)

    def _release(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        complete = final or not new_text.endswith(REPLACEMENT_CHAR)
        # Characters before an incomplete tail are final: the bytes after them start afresh.
        visible = new_text if complete else new_text.rstrip(REPLACEMENT_CHAR)
        delta = visible[len(prefix_text) + self._num_shown_past_read :]
        # Only move the window once it produced text: a window of skipped special tokens alone
        # would lose the left context of the next token.
        if complete and len(new_text) > len(prefix_text):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_shown_past_read = 0
        else:
            self._num_shown_past_read += len(delta)
        if delta:
            self._text_parts.append(delta)
        return delta

    def push(self, new_ids: Iterable[int]) -> str:
        """Appends `new_ids`; returns the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Releases held-back text (an incomplete character at the end shows as U+FFFD)."""
        return self._release(final=True)


@dataclass(frozen=True)
class StopMatch:
    """What a `StopStringMatcher.push` released."""

    text: str  # safe to show now
    stop: str | None = None  # the stop string that completed, None if none did


class StopStringMatcher:
    """Finds stop strings in a stream of text deltas, across delta boundaries.

    Text that could be the start of a stop string is held back until it is known not to be one,
    so a stream never shows part of a stop string. On a match the released text ends before the
    stop string (or after it with `include_stop_str_in_output`) and everything after is dropped.
    When several stop strings complete in the same delta, the one that ends first wins; on a tie,
    the one that starts first.
    """

    def __init__(self, stop_strings: Iterable[str], include_stop_str_in_output: bool = False):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.include_stop = include_stop_str_in_output
        self._pending = ""  # held back: a suffix that is a proper prefix of some stop string
        self.stopped: str | None = None

    def _held_len(self, text: str) -> int:
        best = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, delta: str) -> StopMatch:
        if self.stopped is not None:
            return StopMatch("", self.stopped)
        if not self.stop_strings:
            return StopMatch(delta)
        text = self._pending + delta
        found: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if found is None or cand[:2] < found[:2]:
                    found = cand
        if found is not None:
            end, start, stop = found
            self.stopped = stop
            self._pending = ""
            return StopMatch(text[: end if self.include_stop else start], stop)
        held = self._held_len(text)
        self._pending = text[len(text) - held :] if held else ""
        return StopMatch(text[: len(text) - held])

    def flush(self) -> str:
        """At the end of the stream, the held-back text is no stop string: release it."""
        text, self._pending = self._pending, ""
        return "" if self.stopped is not None else text


@dataclass(frozen=True)
class StreamStep:
    """One round's text for a request."""

    text: str  # delta to show
    stop: str | None = None  # the stop string that ended the output
    num_kept_ids: int = 0  # how many of the pushed ids belong to the output (all, unless stop)


class OutputStream:
    """Detokenizer and stop strings of one request; the engine calls `push` once per round with
    the round's emitted ids. On a stop string the token in which it completes is the last kept
    one: the engine truncates the output (and the KV) after `num_kept_ids` of the pushed ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        stop_strings: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop_strings, include_stop_str_in_output)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """Output text released so far (stop string excluded unless asked for)."""
        return "".join(self._text_parts)

    @property
    def stopped(self) -> str | None:
        return self.matcher.stopped

    def push(self, new_ids: Sequence[int]) -> StreamStep:
        if self.matcher.stopped is not None:
            return StreamStep("", self.matcher.stopped, 0)
        if not self.matcher.stop_strings:  # one decode window for the whole round
            delta = self.detokenizer.push(new_ids)
            self._text_parts.append(delta)
            return StreamStep(delta, None, len(new_ids))
        parts: list[str] = []
        for i, token_id in enumerate(new_ids):
            match = self.matcher.push(self.detokenizer.push((token_id,)))
            parts.append(match.text)
            if match.stop is not None:
                delta = "".join(parts)
                self._text_parts.append(delta)
                return StreamStep(delta, match.stop, i + 1)
        delta = "".join(parts)
        self._text_parts.append(delta)
        return StreamStep(delta, None, len(new_ids))

    def finish(self) -> StreamStep:
        """Call when the output ends (EOS, length, abort): releases held-back text. The held
        tail may still complete a stop string, which then cuts it."""
        if self.matcher.stopped is not None:
            return StreamStep("", self.matcher.stopped, 0)
        match = self.matcher.push(self.detokenizer.finish())
        delta = match.text + (self.matcher.flush() if match.stop is None else "")
        self._text_parts.append(delta)
        return StreamStep(delta, match.stop, 0)
