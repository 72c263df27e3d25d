"""User-facing request/output types shared by the offline `LLM` API, the engine and the server.

`SamplingParams` follows the names users know from vLLM. The engine turns it into the
scheduler's `RequestSpec` and the executor's `SamplingSpec`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from scheduler.plan import GrammarSpec, SamplingSpec, TokenLogprob

SPECULATION_CHOICES = ("auto", "on", "off")
MAX_CACHE_SALT_LEN = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0  # |bias| at most


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's structured outputs: the output must match exactly one of these. `json`: a JSON
    schema (a dict or its JSON text); `regex`; `choice`: one of these strings; `grammar`: a Lark
    or GBNF grammar; `json_object`: any JSON object. Every row the request samples or verifies
    is masked to what the grammar allows; the end of the output is allowed only once it is
    complete. A tool call's arguments are a JSON schema on the same path."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # the request field the constraint came from (errors name it); the server sets it
    source_field: str = "structured_outputs"

    def _kinds(self) -> list[str]:
        return [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])

    @property
    def field(self) -> str:
        """The request field an error about the constraint names."""
        if self.source_field != "structured_outputs":
            return self.source_field
        kinds = self._kinds()
        return f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs"

    def grammar_spec(self) -> GrammarSpec:
        """The constraint as the executor compiles it; ValueError naming the field when it is
        not exactly one well-formed constraint."""
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError(
                f"{self.field} takes exactly one of json, regex, choice, grammar, json_object"
                f" (got {', '.join(kinds) or 'none'})"
            )
        kind = kinds[0]
        if kind == "json_object":
            return GrammarSpec("json_object")
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = msgspec.json.decode(schema)
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{self.field} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"{self.field} must be a JSON schema object")
            return GrammarSpec("json", msgspec.json.encode(schema).decode())
        if kind == "choice":
            choices = self.choice
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"{self.field} must be a non-empty list of non-empty strings")
            return GrammarSpec("choice", msgspec.json.encode(choices).decode())
        source = getattr(self, kind)
        if not source:
            raise ValueError(f"{self.field} must be a non-empty string")
        return GrammarSpec(kind, source)


class SamplingParams(msgspec.Struct, kw_only=True):
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; None: off
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculation: str = "auto"  # auto | on | off (within what the tenant allows)
    # vLLM's request field: requests share cached prefix KV only with requests of the same
    # salt (inside the tenant's own cache unless the operator shares one)
    cache_salt: str | None = None
    # OpenAI's: token id -> bias in [-100, 100] added to its logit (-100 bans it, +100 forces it)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def validate(self) -> None:
        """Raises ValueError naming the field on out-of-range values."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_LEN
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters"
            )
        if self.speculation not in SPECULATION_CHOICES:
            raise ValueError(
                f"speculation must be one of {', '.join(SPECULATION_CHOICES)}, "
                f"got {self.speculation!r}"
            )
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
                )
            for token, bias in self.logit_bias.items():
                if token < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
                if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                    raise ValueError(
                        f"logit_bias values must be in [-100, 100], got {bias} for token {token}"
                    )
        if self.structured_outputs is not None:
            self.structured_outputs.grammar_spec()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return tuple(s for s in self.stop if s)

    def to_spec(self, seed: int | None = None) -> SamplingSpec:
        """The executor's view. `seed` overrides self.seed (n > 1 derives one seed per choice)."""
        bias = sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())
        so = self.structured_outputs
        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed if seed is None else seed,
            logprobs=self.logprobs,
            logit_bias=tuple(bias),
            grammar=None if so is None else so.grammar_spec(),
        )


class CompletionOutput(msgspec.Struct, kw_only=True):
    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
