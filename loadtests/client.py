"""Streams one OpenAI-style completion and records when each token-carrying chunk arrived.

Works against any server that speaks the OpenAI streaming API (`/v1/completions` or
`/v1/chat/completions` with `stream: true`). Token counts per chunk matter for throughput, and a
speculative server may put several tokens in one chunk, so they are taken from the best source
the server offers, in this order (the record says which one was used):

- `token_ids`: the chunk lists the ids it carries (vLLM's `return_token_ids`, and this project);
- `logprobs`: one logprob entry per token, when the request asked for them;
- `usage`: only the final usage count is known; it is spread over the chunks in proportion to
  their text length (every chunk carries at least one token when the total allows);
- `chunks`: no usage either; one token per chunk (an estimate, flagged as such).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from loadtests.records import RequestRecord
from loadtests.sse import SSEParser


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # the API root, e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: str = "completions"  # completions | chat
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True  # generate exactly max_tokens: reproducible token counts
    extra_body: dict = field(default_factory=dict)  # merged into every request body


@dataclass(frozen=True)
class PlannedRequest:
    req_id: int
    prompt_id: str
    prompt: str
    tenant: str = "default"
    api_key: str | None = None
    seed: int = 0
    messages: tuple[dict, ...] | None = None  # chat messages; None sends `prompt` as a user turn
    # what a workload knows of the request (its group, conversation, turn); copied to the record
    tags: dict = field(default_factory=dict, compare=False)


def request_body(cfg: ClientConfig, req: PlannedRequest) -> dict:
    body: dict = {
        "model": cfg.model,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": req.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = (
            list(req.messages)
            if req.messages is not None
            else [{"role": "user", "content": req.prompt}]
        )
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


def endpoint_url(cfg: ClientConfig) -> str:
    path = "chat/completions" if cfg.endpoint == "chat" else "completions"
    return f"{cfg.base_url.rstrip('/')}/{path}"


@dataclass
class _Chunk:
    time_s: float
    num_tokens: int | None  # None: the chunk does not say
    text_len: int
    source: str = ""


def _parse_choice(choice: dict) -> tuple[str, str, int | None, str]:
    """(text, content, tokens when the chunk says, source) of one streamed choice. The text
    counts reasoning too (it took tokens); the content is what a chat history keeps."""
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        content = str(delta.get("content") or "")
        text = "".join(str(delta.get(k) or "") for k in ("reasoning_content", "reasoning"))
        text += content
    else:
        text = content = str(choice.get("text") or "")
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return text, content, len(ids), "token_ids"
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("content") if isinstance(delta, dict) else logprobs.get("tokens")
        if isinstance(entries, list):
            return text, content, len(entries), "logprobs"
    return text, content, None, ""


def spread_tokens(total: int, weights: list[int]) -> list[int]:
    """Integer split of `total` over chunks in proportion to their weight (largest remainder).
    A chunk is only sent when it carries something, so when `total` allows, every chunk gets at
    least one token, taken from the largest share."""
    n = len(weights)
    if n == 0:
        return []
    w = [max(x, 1) for x in weights]
    shares = [total * x / sum(w) for x in w]
    out = [int(s) for s in shares]
    order = sorted(range(n), key=lambda i: (-(shares[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    if total >= n:
        for i in range(n):
            if out[i] == 0:
                out[max(range(n), key=lambda j: out[j])] -= 1
                out[i] = 1
    return out


async def stream_request(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    req: PlannedRequest,
    clock: Callable[[], float],
) -> RequestRecord:
    """Send one streaming request; never raises for server or network errors (they are recorded)."""
    headers = {"Authorization": f"Bearer {req.api_key}"} if req.api_key else {}
    chunks: list[_Chunk] = []
    content: list[str] = []
    usage: dict | None = None
    finish_reason: str | None = None
    error = ""
    submit = clock()
    try:
        async with http.stream(
            "POST", endpoint_url(cfg), json=request_body(cfg, req), headers=headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                error = f"HTTP {resp.status_code}: {body[:300]}"
            else:
                parser = SSEParser()
                done = False
                async for piece in resp.aiter_bytes():
                    now = clock()
                    for event in parser.feed(piece):
                        if event.data.strip() == "[DONE]":
                            done = True
                            break
                        payload = json.loads(event.data)
                        if "error" in payload:
                            err = payload["error"]
                            msg = err.get("message") if isinstance(err, dict) else err
                            error = f"stream error: {msg}"
                            done = True
                            break
                        if payload.get("usage"):
                            usage = payload["usage"]
                        for choice in payload.get("choices") or []:
                            if choice.get("index", 0) != 0:
                                continue
                            text, reply, num, source = _parse_choice(choice)
                            content.append(reply)
                            if text or num:
                                chunks.append(_Chunk(now, num, len(text), source))
                            finish_reason = choice.get("finish_reason") or finish_reason
                    if done:
                        break
                if not done and not error:
                    error = "stream ended without [DONE]"
    except (httpx.HTTPError, OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # Network failures, and streams that are not the OpenAI shape (ValueError covers bad
        # JSON): one failed request, never a failed run.
        error = f"{type(exc).__name__}: {exc}"
    end = clock()
    return _record(req, submit, end, chunks, usage, finish_reason, error, "".join(content))


def _record(
    req: PlannedRequest,
    submit: float,
    end: float,
    chunks: list[_Chunk],
    usage: dict | None,
    finish_reason: str | None,
    error: str,
    output_text: str = "",
) -> RequestRecord:
    usage_out = usage.get("completion_tokens") if isinstance(usage, dict) else None
    usage_out = usage_out if isinstance(usage_out, int) else None
    num_prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if chunks and all(c.num_tokens is not None for c in chunks):
        counts = [int(c.num_tokens or 0) for c in chunks]
        source = chunks[0].source
    elif usage_out is not None:
        counts = spread_tokens(usage_out, [c.text_len for c in chunks])
        source = "usage"
    else:
        counts = [1] * len(chunks)
        source = "chunks"
    return RequestRecord(
        req_id=req.req_id,
        tenant=req.tenant,
        submit_s=submit,
        end_s=end,
        chunk_times_s=tuple(c.time_s for c in chunks),
        chunk_tokens=tuple(counts),
        num_prompt_tokens=num_prompt if isinstance(num_prompt, int) else 0,
        num_output_tokens=usage_out if usage_out is not None else sum(counts),
        token_count_source=source,
        finish_reason=finish_reason,
        error=error,
        prompt_id=req.prompt_id,
        extra=dict(req.tags),
        output_text=output_text,
    )


async def detect_model(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model the server lists at GET /models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await http.get(f"{base_url.rstrip('/')}/models", headers=headers)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return str(models[0]["id"])
