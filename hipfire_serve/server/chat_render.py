"""Chat messages to prompt text for the chat API and `/tokenize`, with vLLM's rendering options:
`add_generation_prompt`, `continue_final_message` (the reply continues the last message, no
end-of-turn after it), `chat_template_kwargs` (extra template variables) and OpenAI's
`reasoning_effort` (a template variable where the template reads it, as gpt-oss's does)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hipfire_serve.server.protocol import RequestError

# template variables the request's own fields set; chat_template_kwargs may not override them
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message"}
)


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The rendered conversation; RequestError naming the field on a bad combination, and
    ValueError (the caller's 400 on `messages`) when the template rejects the messages."""
    if continue_final_message and add_generation_prompt:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    kwargs = dict(template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if clash:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields do",
            "chat_template_kwargs",
        )
    if reasoning_effort is not None:
        if "reasoning_effort" not in template_variables(tokenizer):
            raise RequestError(
                "reasoning_effort is not supported: this model's chat template does not read it",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = reasoning_effort
    if tools is not None:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The variables the tokenizer's chat template reads (none known: empty)."""
    read = getattr(tokenizer, "chat_template_variables", None)
    return read() if read is not None else frozenset()


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`text` up to the end of the last message's content: what the template writes after it
    (end of turn, a new turn) is what the reply is to continue instead."""
    final = str(messages[-1].get("content") or "").strip() if messages else ""
    end = text.rfind(final) if final else -1
    if end < 0:
        raise RequestError(
            "continue_final_message needs a last message with content that the chat template "
            "writes out as it is",
            "continue_final_message",
        )
    return text[: end + len(final)]
