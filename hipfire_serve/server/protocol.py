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
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from hipfire_serve.types import SPECULATION_CHOICES, SamplingParams, StructuredOutputsParams

# n > 1 fans out inside the engine; a bound keeps one request from filling the slot pool.
MAX_N = 64
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


class JsonSchemaFormat(_NullIsDefault, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced whatever it says


class ResponseFormat(_NullIsDefault, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_NullIsDefault, kw_only=True):
    """vLLM's `structured_outputs`; the options typed Any are refused unless at their default."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None
    disable_fallback: Any = None  # accepted: there is one grammar library, nothing to fall to


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
    # output constraints (see `structured_outputs`) and OpenAI's logit_bias
    logit_bias: dict[str, float] | None = None  # token ids as JSON keys: strings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: Any = None
    # vLLM's extras (request_fields.py checks them and the ones served only at their neutral
    # value, typed Any so that any value reaches that check)
    best_of: int | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = False
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    prompt_embeds: Any = None
    return_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec cannot express a union of several
    # array types, so the shape is checked by `prompt_inputs`.
    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool | None = True


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI's is JSON text; an object is taken


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str | None = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: ToolChoiceFunction | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    # tool calling (tool_choice.py checks them)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's chat extras
    echo: bool | None = False
    add_special_tokens: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's and vLLM's fields served only at their neutral value (request_fields.py)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    documents: Any = None


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


def chat_messages(messages: list[ChatMessage] | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: role and plain text content, an assistant's
    `tool_calls` with each call's arguments as an object (templates write them with `tojson`,
    as Hugging Face's tool templates do), a tool message's `tool_call_id` and `name`."""
    if not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
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
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls is not None:
            if role != "assistant":
                where = f"messages[{i}].tool_calls"
                raise RequestError(f"{where}: only assistant messages carry tool calls", where)
            entry["tool_calls"] = [
                _template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(message.tool_calls)
            ]
        if role == "tool":
            if not message.tool_call_id:
                where = f"messages[{i}].tool_call_id"
                raise RequestError(f"{where} is required: the id of the call answered", where)
            entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
        out.append(entry)
    return out


def _template_tool_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    if call.type not in (None, "function"):
        raise RequestError(f"{where}.type must be function, got {call.type!r}", f"{where}.type")
    arguments: Any = call.function.arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = msgspec.json.decode(arguments)
        except msgspec.DecodeError as exc:
            raise RequestError(
                f"{where}.function.arguments is not valid JSON: {exc}",
                f"{where}.function.arguments",
            ) from None
    elif not isinstance(arguments, dict):
        arguments = {}
    entry: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        entry["id"] = call.id
    return entry


_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    defaults: Mapping[str, Any] = _NO_DEFAULTS,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams, range-checked (RequestError naming
    the field). `max_tokens` and `logprobs` are resolved by the endpoint (they differ);
    `defaults` fills the optional sampling fields the request leaves out."""
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
    # a field the request leaves out takes the server's default (--generation-config)
    optional = {k: defaults.get(k) if v is None else v for k, v in optional.items()}
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        speculation=req.speculation,
        cache_salt=req.cache_salt,
        logit_bias=_logit_bias(req.logit_bias),
        structured_outputs=structured_outputs(req),
        **{k: v for k, v in optional.items() if v is not None},
    )
    try:
        params.validate()
    except ValueError as exc:
        message = str(exc)
        raise RequestError(message, message.split(" ", 1)[0]) from None
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys (token ids as strings) as ints; RequestError otherwise."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        bad = next(t for t in bias if not t.strip().lstrip("-").isdigit())
        message = f"logit_bias keys must be token ids, got {bad!r}"
        raise RequestError(message, "logit_bias") from None


_UNSUPPORTED_OPTIONS = (
    "structural_tag",
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_additional_properties",
)
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"))


def structured_outputs(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field sets it: OpenAI's
    `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields. RequestError
    naming the field for an unsupported option or a second constraint."""
    found: list[StructuredOutputsParams] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutputsParams(json_object=True, source_field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        where = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise RequestError(f"{where} is required with type json_schema", where)
        found.append(StructuredOutputsParams(json=rf.json_schema.schema, source_field=where))
    elif rf is not None and rf.type != "text":
        raise RequestError(
            f"response_format.type must be text, json_object or json_schema, got {rf.type!r}",
            "response_format.type",
        )
    so = req.structured_outputs
    if so is not None:
        for name in _UNSUPPORTED_OPTIONS:
            if getattr(so, name) not in (None, False):
                where = f"structured_outputs.{name}"
                raise RequestError(f"{where} is not supported", where)
        found.append(
            StructuredOutputsParams(
                json=so.json,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
            )
        )
    for name, kind in (*_GUIDED, ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredOutputsParams(**{kind: value}, source_field=name))
    if req.guided_whitespace_pattern is not None:
        where = "guided_whitespace_pattern"
        raise RequestError(f"{where} is not supported", where)
    if len(found) > 1:
        raise RequestError(
            f"{found[1].field} and {found[0].field} both constrain the output; send one",
            found[1].field,
        )
    return found[0] if found else None


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


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: ToolCallFunction


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None  # required by the spec, never produced
    # left out of messages without calls (the spec allows no key, not null)
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Response, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class FunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call's first delta carries its id, type and name; later ones only arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
