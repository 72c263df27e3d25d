"""User-facing request/output types shared by the offline `LLM` API, the engine and the server.

`SamplingParams` follows the names users know from vLLM. The engine turns it into the
scheduler's `RequestSpec` and the executor's `SamplingSpec`.
"""

from __future__ import annotations

import msgspec

from scheduler.plan import SamplingSpec, TokenLogprob

SPECULATION_CHOICES = ("auto", "on", "off")
MAX_CACHE_SALT_LEN = 1024


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

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return tuple(s for s in self.stop if s)

    def to_spec(self, seed: int | None = None) -> SamplingSpec:
        """The executor's view. `seed` overrides self.seed (n > 1 derives one seed per choice)."""
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
