"""Request fields of OpenAI's and vLLM's schemas that this server does not serve as asked: each
is accepted at its neutral value (absent, null, or the value that changes nothing) and answered
with a 400 naming it otherwise, so that no request is silently served differently from what it
asked. `best_of` is served when it equals `n` (every choice is returned then)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hipfire_serve.server.protocol import ChatCompletionRequest, RequestError


def _unset(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _one(value: Any) -> bool:
    return value is None or value == 1


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _on(value: Any) -> bool:
    return value is None or value is True


def _text_only(value: Any) -> bool:
    return value is None or value == ["text"]


# field -> (is the value one served as asked, why any other is not)
_BOTH: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_off, "beam search is not supported"),
    "length_penalty": (_one, "length_penalty scores beams, and beam search is not supported"),
    "allowed_token_ids": (_empty, "allowed_token_ids is not supported"),
    "bad_words": (_empty, "bad_words is not supported"),
    "logits_processors": (_empty, "custom logits processors are not supported"),
    "prompt_logprobs": (_unset, "prompt logprobs are not computed"),
    "prompt_embeds": (_unset, "prompt embeddings are not accepted; send text or token ids"),
    "return_token_ids": (_off, "return_token_ids is not supported"),
    "spaces_between_special_tokens": (_on, "special tokens are always decoded with spaces"),
    "priority": (
        _zero,
        "a request's priority is its tenant's (the tenants file's priority), not its own",
    ),
    "kv_transfer_params": (_unset, "KV transfer between instances is not supported"),
    "vllm_xargs": (_empty, "vllm_xargs is not supported"),
}
_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_unset, "audio output is not supported"),
    "modalities": (_text_only, "only the text modality is supported"),
    "functions": (_unset, "functions is deprecated and not supported; use tools"),
    "function_call": (_unset, "function_call is deprecated and not supported; use tool_choice"),
    "verbosity": (_unset, "verbosity is not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "store": (_off, "responses are not stored"),
    "chat_template": (
        _unset,
        "a chat template per request is not accepted; the server's is set with --chat-template",
    ),
    "mm_processor_kwargs": (_empty, "multimodal inputs are not supported"),
    "documents": (_unset, "documents are not supported; put them in the messages"),
}


def check_request_fields(req: Any) -> None:
    """RequestError (400) naming the first field the request asks for that is not served as
    asked, or whose value is out of range."""
    checks = (_BOTH, _CHAT) if isinstance(req, ChatCompletionRequest) else (_BOTH,)
    for table in checks:
        for name, (served, reason) in table.items():
            if not served(getattr(req, name)):
                raise RequestError(f"{name}: {reason}", name)
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError(
            f"best_of={req.best_of} with n={req.n} is not supported: it would generate best_of "
            "choices and return the n most likely; leave best_of out or set it to n",
            "best_of",
        )
    k = req.truncate_prompt_tokens
    if k is not None and k != -1 and k < 1:
        raise RequestError(
            f"truncate_prompt_tokens must be -1 (the model's context) or >= 1, got {k}",
            "truncate_prompt_tokens",
        )


def truncate_prompt(token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The last `k` tokens of a prompt (vLLM's `truncate_prompt_tokens`; -1: the context)."""
    if k is None:
        return token_ids
    keep = max_model_len if k == -1 else k
    return token_ids[-keep:] if len(token_ids) > keep else token_ids
