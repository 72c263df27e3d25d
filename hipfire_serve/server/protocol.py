"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests ignore unknown fields (clients send vendor extras) and are decoded strictly otherwise:
a wrong type becomes a `RequestError` naming the field. An explicit `null` for an optional field
means its default, as OpenAI's API reads it. Range checks reuse `SamplingParams.validate`, so the
server and the offline API reject the same values.
Response Structs carry every key OpenAI's OpenAPI spec requires, `null` where it allows that
(`logprobs`, chat `refusal`, `finish_reason` in stream chunks), and leave out
`system_fingerprint`, which the spec allows only as a string.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from hipfire_serve.types import SPECULATION_CHOICES, SamplingParams

# n > 1 fans out inside the engine; a bound keeps one request from filling the slot pool.
MAX_N = 64
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant")


class RequestError(Exception):
    """A client error: answered with 400 (or `status`) in OpenAI's error shape."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class _NullIsDefault(msgspec.Struct, kw_only=True):
    """A request Struct whose optional fields read an explicit `null` as their default.

    OpenAI's spec marks its optional request fields nullable, and clients send `null` for
    "not set". A field declared `T | None = default` with a non-None default gets that default
    back here, so the code reading it sees a `T`.
    """

    def __post_init__(self) -> None:
        for name, default in _non_null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


_NON_NULL_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _non_null_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    found = _NON_NULL_DEFAULTS.get(cls)
    if found is None:
        found = _NON_NULL_DEFAULTS[cls] = tuple(
            (f.name, f.default)
            for f in msgspec.structs.fields(cls)
            if f.default is not msgspec.NODEFAULT and f.default is not None
        )
    return found


class StreamOptions(_NullIsDefault, kw_only=True):
    include_usage: bool | None = False


class _SamplingFields(_NullIsDefault, kw_only=True):
    """Fields shared by both endpoints (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: str | None = "auto"
    cache_salt: str | None = None  # vLLM's: prefix-cache isolation finer than the tenant's


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec cannot express a union of several
    # array types, so the shape is checked by `prompt_inputs`.
    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")


def decode_request(body: bytes, request_type: type) -> Any:
    """JSON bytes -> request Struct; RequestError naming the offending field otherwise."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH_RE.search(message)
        param = None
        if match:
            # `$.messages[0].role` -> `messages[0].role`; the top-level name is what clients match.
            param = match.group(1) or None
        raise RequestError(message, param) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        # The decoder recurses per nesting level, unknown (skipped) fields included.
        raise RequestError("request body is not valid JSON: nested too deeply") from None


def prompt_inputs(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of single prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        "token ids (none of them empty)",
        "prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def chat_messages(messages: list[ChatMessage] | None) -> list[dict[str, str]]:
    """Messages as the chat template expects them: role and plain text content."""
    if not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
                f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"messages[{i}].content: only text parts are supported, "
                        f"got type {part.type!r}",
                        f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or ""})
    return out


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams, range-checked (RequestError naming
    the field). `max_tokens` and `logprobs` are resolved by the endpoint (they differ)."""
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.speculation not in SPECULATION_CHOICES:
        raise RequestError(
            f"speculation must be one of {', '.join(SPECULATION_CHOICES)}, got {req.speculation!r}",
            "speculation",
        )
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise RequestError("stop_token_ids must be non-negative token ids", "stop_token_ids")
    if isinstance(req.stop, list) and len(req.stop) > 16:
        raise RequestError("stop takes at most 16 strings", "stop")
    # Seeds are opaque to users: fold any integer into the generator's 63-bit range
    # (same seed in, same output out).
    seed = None if req.seed is None else req.seed % (1 << 63)
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        speculation=req.speculation,
        cache_salt=req.cache_salt,
        **{k: v for k, v in optional.items() if v is not None},
    )
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        raise RequestError(message, message.split(" ", 1)[0]) from None
    return params


def check_capacity(num_prompts: int, n: int, *, num_slots: int, max_queue: int) -> None:
    """RequestError (400) for a request the engine could never take in whole, however long the
    client waited (a 503 would invite retries that cannot succeed): one prompt's `n` choices
    enter the queue together, and all of a request's choices must fit in the slots plus the
    queue at once."""
    if n > max_queue:
        raise RequestError(
            f"n={n} choices of one prompt enter the queue together, but it holds {max_queue} "
            f"requests: this request can never be served; use n <= {max_queue}",
            "n",
        )
    num_choices = num_prompts * n
    if num_choices > num_slots + max_queue:
        raise RequestError(
            f"{num_prompts} prompt(s) x n={n} = {num_choices} choices, but the server holds at "
            f"most {num_slots + max_queue} at once ({num_slots} slots + {max_queue} queue "
            "places): this request can never be served; send fewer prompts or a smaller n",
            "n" if num_prompts == 1 else "prompt",
        )


# --- responses -------------------------------------------------------------------------------


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Extras beyond OpenAI's shape: speculative decoding work behind this response.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class _Response(msgspec.Struct, kw_only=True):
    """The envelope every response shares; a subclass sets `object` and the choice type
    (fields keep these positions, so each response encodes in OpenAI's key order)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response, kw_only=True):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob, kw_only=True):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None  # required by the spec, never produced


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None  # required by the spec, never produced


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Response, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response, kw_only=True):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "hipfire-serve"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo
