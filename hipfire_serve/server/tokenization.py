"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes.

/tokenize takes a `prompt` (special tokens added unless `add_special_tokens` is false) or chat
`messages` rendered by the served chat template (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `tools`; special tokens not added again
unless asked) and answers `{count, max_model_len, tokens, token_strs}`, the vocabulary pieces
in `token_strs` with `return_token_strs`. A prompt longer than the context is counted, not
refused: `max_model_len` beside `count` says whether it fits. /detokenize turns `tokens` back
into `{prompt}`, special tokens included, as vLLM decodes them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hipfire_serve.server.chat_render import render_chat
from hipfire_serve.server.protocol import (
    ChatMessage,
    RequestError,
    ToolDefinition,
    _NullIsDefault,
    chat_messages,
    decode_request,
)
from hipfire_serve.server.tool_choice import check_tools, template_tools


class TokenizeRequest(_NullIsDefault, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = False
    chat_template: Any = None
    mm_processor_kwargs: Any = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_NullIsDefault, kw_only=True):
    model: str | None = None
    tokens: list[int] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


def check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {served!r}", "model", status=404
        )


def tokenize(body: bytes, tokenizer: Any, *, model_name: str, max_model_len: int) -> bytes:
    """A /tokenize body -> its JSON reply; RequestError naming the field otherwise."""
    req = decode_request(body, TokenizeRequest)
    check_model(req.model, model_name)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give either prompt or messages", "prompt")
    if req.chat_template is not None:
        raise RequestError(
            "chat_template: a chat template per request is not accepted; the server's is set "
            "with --chat-template",
            "chat_template",
        )
    if req.mm_processor_kwargs:
        raise RequestError("mm_processor_kwargs: multimodal inputs are not supported")
    if req.messages is not None:
        try:
            text = render_chat(
                tokenizer,
                chat_messages(req.messages),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                tools=_template_tools(req.tools),
            )
        except RequestError:
            raise
        except ValueError as exc:
            message = f"the chat template rejected the messages: {exc}"
            raise RequestError(message, "messages") from None
        add_special = bool(req.add_special_tokens)
    else:
        text = req.prompt
        add_special = req.add_special_tokens is not False
    ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    pieces = [tokenizer.id_to_piece(i) for i in ids] if req.return_token_strs else None
    reply = TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=pieces
    )
    return msgspec.json.encode(reply)


def _template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    check_tools(tools)
    return template_tools(tools)


def detokenize(body: bytes, tokenizer: Any, *, model_name: str) -> bytes:
    """A /detokenize body -> its JSON reply; RequestError naming the field otherwise."""
    req = decode_request(body, DetokenizeRequest)
    check_model(req.model, model_name)
    if req.tokens is None:
        raise RequestError("tokens is required (a list of token ids)", "tokens")
    vocab_size = getattr(tokenizer, "vocab_size", None)
    for i, token_id in enumerate(req.tokens):
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise RequestError(
                f"tokens[{i}] = {token_id} is not a token id of this model's vocabulary "
                f"(0..{(vocab_size or 1) - 1})",
                "tokens",
            )
    prompt = tokenizer.decode(req.tokens, skip_special_tokens=False)
    return msgspec.json.encode(DetokenizeResponse(prompt=prompt))
