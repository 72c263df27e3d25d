"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests ignore unknown fields (clients send vendor extras) and are decoded strictly otherwise:
a wrong type becomes a `RequestError` naming the field. Range checks reuse
`SamplingParams.validate`, so the server and the offline API reject the same values.
Response Structs omit nothing OpenAI's clients read; `None` fields are sent as `null` because
the official shapes carry them (`logprobs: null`, `finish_reason: null` in stream chunks).
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

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculation: str = "auto"


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec cannot express a union of several
    # array types, so the shape is checked by `prompt_inputs`.
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
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
    logprobs: bool = False
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
        **{k: v for k, v in optional.items() if v is not None},
    )
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        raise RequestError(message, message.split(" ", 1)[0]) from None
    return params


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
    system_fingerprint: str | None = None


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


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None


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
