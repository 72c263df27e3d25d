"""One generation request in flight: from a decoded OpenAI request to the JSON or SSE reply.

`GenerationPlan` is what a request asks for (prompts as token ids, sampling parameters, the
endpoint's response flavour); `Generation` runs it against the engine loop and turns the
per-round deltas into OpenAI's shapes, keeping the per-request metrics as it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hipfire_serve.server import http
from hipfire_serve.server.engine_client import EngineClient, RequestStream, StreamClosed
from hipfire_serve.server.metrics import ServerMetrics
from hipfire_serve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)
from hipfire_serve.server.tool_choice import ToolPlan
from hipfire_serve.server.tool_stream import ChoiceTools
from hipfire_serve.types import RequestOutput, SamplingParams

# finish reasons the server reports as errors instead of choices
_STATUS_OF_CLOSE = {"timeout": 504, "shutdown": 503, "error": 500, "engine_failed": 503}
_MESSAGE_OF_CLOSE = {
    "timeout": "request timed out (--request-timeout) and was aborted",
    "shutdown": "the server is shutting down; the request was aborted",
    "error": "the engine failed while generating this request",
    "engine_failed": "the engine stopped serving ({fault}); the request was aborted, retry it",
}


@dataclass(frozen=True)
class GenerationPlan:
    chat: bool  # chat.completion shapes instead of text_completion
    prompt_token_ids: list[list[int]]  # one entry per prompt
    echo_texts: list[str]  # prepended to each prompt's choices ("" without echo)
    params: SamplingParams
    stream: bool
    include_usage: bool
    want_logprobs: bool
    max_tokens_charged: int  # tokens charged to the tenant's tokens/min bucket
    request_id: str | None = None  # the client's (vLLM's field): the response id's tail
    tokens_as_ids: bool = False  # logprob tokens as "token_id:N" (vLLM's field)
    tools: ToolPlan | None = None  # chat: the request's tools and tool_choice


@dataclass
class _Choice:
    index: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    text_len: int = 0  # characters so far (echo included), for completion logprob offsets
    lp_tokens: list[str] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    lp_top: list[dict[str, float]] = field(default_factory=list)
    lp_offsets: list[int] = field(default_factory=list)
    chat_lps: list[ChatTokenLogprob] = field(default_factory=list)
    tools: ChoiceTools | None = None  # reads tool calls out of the text


class _DeltaView(NamedTuple):
    """One choice's delta of a round, as the stream reports it."""

    index: int  # choice index in the response
    text: str
    finish_reason: str | None
    lp_start: int  # this delta's logprobs are the choice's [lp_start, lp_end)
    lp_end: int


class TokenTexts:
    """Token id -> its text, cached (the vocabulary is bounded, logprobs ask the same ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizer.decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = text
        return text


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class Generation:
    def __init__(
        self,
        plan: GenerationPlan,
        *,
        engine: EngineClient,
        metrics: ServerMetrics,
        token_texts: TokenTexts,
        model_name: str,
        tenant: str,
        arrival: float,
        on_tokens_unused: Callable[[int], None],
        stream_interval: int = 1,
        retry_after_s: int = 1,
    ) -> None:
        self.plan = plan
        self.engine = engine
        self.metrics = metrics
        self.token_texts = token_texts
        self.model_name = model_name
        self.tenant = tenant
        self.arrival = arrival
        self.on_tokens_unused = on_tokens_unused
        self.retry_after_s = retry_after_s
        prefix = "chatcmpl-" if plan.chat else "cmpl-"
        unique = uuid.uuid4().hex
        self.id = prefix + (plan.request_id or unique)
        self.created = int(time.time())
        n = plan.params.n
        # engine ids stay unique whatever id the client chose
        self.engine_ids = [f"{prefix}{unique}-{i}" for i in range(len(plan.prompt_token_ids))]
        self._prompt_of_engine_id = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.choices = [_Choice(index=i) for i in range(len(self.engine_ids) * n)]
        for choice in self.choices:
            choice.text_len = len(plan.echo_texts[choice.index // n])
            if plan.chat and plan.tools is not None and plan.tools.new_parser is not None:
                choice.tools = ChoiceTools(plan.tools.new_parser(), plan.tools.max_calls)
        # Non-streamed replies need only the end: wake the handler once, not every round.
        self.stream = RequestStream(wake_every=stream_interval if plan.stream else 1 << 30)
        self._unfinished = set(self.engine_ids)
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._closed = False

    # --- lifecycle ---

    async def submit(self) -> None:
        """Adds every prompt to the engine; on failure, aborts the ones already added and
        re-raises the engine's exception."""
        added: list[str] = []
        try:
            for rid, token_ids in zip(self.engine_ids, self.plan.prompt_token_ids):
                if self.stream.closed_reason is not None:
                    break  # aborted (disconnect) while adding: add no more
                taken_at = await self.engine.add_request(
                    rid,
                    token_ids,
                    self.plan.params,
                    self.stream,
                    tenant=self.tenant,
                    arrival_time=self.arrival,
                )
                added.append(rid)
                if self.stream.closed_reason is not None:
                    # The abort may have reached the engine before this add did.
                    self.engine.abort(rid)
                self.metrics.request_admitted(self.tenant, len(token_ids), taken_at - self.arrival)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            self._unfinished.clear()
            raise

    def abort(self, reason: str) -> None:
        """Ends the request from the server side; the handler sees StreamClosed(reason)."""
        for rid in self._unfinished:
            self.engine.abort(rid)
        if self._unfinished:
            self._finish_metrics("error" if reason == "engine_failed" else "abort")
        self._unfinished.clear()
        self.stream.close(reason)

    @property
    def done(self) -> bool:
        return not self._unfinished

    async def next_outputs(self) -> list[_DeltaView]:
        """The deltas released since the last call, bookkept (choices, metrics); StreamClosed
        when ended. Latencies use each round's delivery time, not this wake-up's."""
        batch = await self.stream.next_batch()
        views: list[_DeltaView] = []
        for output, delivered_at in batch:
            num_new = self._absorb(output, views)
            if not num_new:
                continue
            if self._first_token_at is None:
                self._first_token_at = delivered_at
                self.metrics.first_token(self.tenant, delivered_at - self.arrival)
                self.metrics.tokens_generated(self.tenant, num_new, None)
            else:
                gap = max(0.0, delivered_at - self._last_token_at)
                self.metrics.tokens_generated(self.tenant, num_new, gap)
            self._last_token_at = delivered_at
        if not self._unfinished and not self._closed:
            self._closed = True
            self._finish_metrics(None)
        return views

    def _absorb(self, output: RequestOutput, views: list[_DeltaView]) -> int:
        prompt_idx = self._prompt_of_engine_id.get(output.request_id)
        if prompt_idx is None:
            return 0
        n = self.plan.params.n
        num_new = 0
        for delta in output.outputs:
            choice = self.choices[prompt_idx * n + delta.index]
            choice.text_parts.append(delta.text)
            choice.num_tokens += len(delta.token_ids)
            num_new += len(delta.token_ids)
            choice.num_draft_tokens = delta.num_draft_tokens
            choice.num_accepted_tokens = delta.num_accepted_tokens
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
            lp_start = len(choice.chat_lps) if self.plan.chat else len(choice.lp_tokens)
            if self.plan.want_logprobs and delta.logprobs:
                self._absorb_logprobs(choice, delta.logprobs)
            lp_end = len(choice.chat_lps) if self.plan.chat else len(choice.lp_tokens)
            choice.text_len += len(delta.text)
            views.append(
                _DeltaView(choice.index, delta.text, delta.finish_reason, lp_start, lp_end)
            )
        if output.finished:
            self._unfinished.discard(output.request_id)
        return num_new

    def _absorb_logprobs(self, choice: _Choice, logprobs: list[Any]) -> None:
        texts = _token_id_text if self.plan.tokens_as_ids else self.token_texts
        offset = choice.text_len
        for lp in logprobs:
            token = texts(lp.token_id)
            if self.plan.chat:
                top = [
                    TopLogprob(token=texts(tid), logprob=v, bytes=list(texts(tid).encode()))
                    for tid, v in lp.top
                ]
                choice.chat_lps.append(
                    ChatTokenLogprob(
                        token=token,
                        logprob=lp.logprob,
                        bytes=list(token.encode()),
                        top_logprobs=top,
                    )
                )
            else:
                choice.lp_tokens.append(token)
                choice.lp_values.append(lp.logprob)
                choice.lp_top.append({texts(tid): v for tid, v in lp.top})
                choice.lp_offsets.append(offset)
                offset += len(token)

    def _finish_metrics(self, forced_reason: str | None) -> None:
        now = time.monotonic()
        ttft = None if self._first_token_at is None else self._first_token_at - self.arrival
        charged = self.plan.max_tokens_charged - sum(c.num_tokens for c in self.choices)
        for choice in self.choices:
            reason = choice.finish_reason or forced_reason or "abort"
            self.metrics.request_finished(
                self.tenant,
                reason,
                e2e_s=now - self.arrival,
                ttft_s=ttft,
                num_output_tokens=choice.num_tokens,
            )
        self.on_tokens_unused(max(0, charged))

    def usage(self) -> Usage:
        num_prompt = sum(len(ids) for ids in self.plan.prompt_token_ids)
        num_completion = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            num_draft_tokens=sum(c.num_draft_tokens for c in self.choices),
            num_accepted_tokens=sum(c.num_accepted_tokens for c in self.choices),
        )

    def error_reason(self) -> str | None:
        return "error" if any(c.finish_reason == "error" for c in self.choices) else None

    # --- replies ---

    async def reply_json(self, send: Any, deadline: float | None) -> None:
        """The whole response once done; `deadline` (event-loop time) ends it with 504."""
        try:
            async with asyncio.timeout_at(deadline):
                while not self.done:
                    await self.next_outputs()
        except TimeoutError:
            self.abort("timeout")
            return await self._send_close_error(send, "timeout")
        except StreamClosed as closed:
            if closed.reason == "engine_failed":
                self.abort("engine_failed")
            return await self._send_close_error(send, closed.reason)
        if self.stream.closed_reason is not None:
            return await self._send_close_error(send, self.stream.closed_reason)
        if self.error_reason():
            return await self._send_close_error(send, "error")
        await http.send_bytes(send, 200, http.encode(self._full_response()))

    async def _send_close_error(self, send: Any, reason: str) -> None:
        if reason == "disconnect":
            return
        status = _STATUS_OF_CLOSE[reason]
        retry_after_s = self.retry_after_s if status == 503 else None
        await http.send_error(
            send, status, self._close_message(reason), retry_after_s=retry_after_s
        )

    def _close_message(self, reason: str) -> str:
        return _MESSAGE_OF_CLOSE[reason].format(fault=self.engine.last_fault or "failed")

    def _full_response(self) -> Completion | ChatCompletion:
        usage = self.usage()
        n = self.plan.params.n
        if self.plan.chat:
            chat_choices = [
                ChatChoice(
                    index=c.index,
                    message=self._chat_message(c),
                    logprobs=ChatLogprobs(content=c.chat_lps) if self.plan.want_logprobs else None,
                    finish_reason=(
                        c.tools.finish_reason(c.finish_reason) if c.tools else c.finish_reason
                    ),
                )
                for c in self.choices
            ]
            return self._response(ChatCompletion, chat_choices, usage)
        choices = [
            CompletionChoice(
                index=c.index,
                text=self.plan.echo_texts[c.index // n] + "".join(c.text_parts),
                logprobs=self._completion_logprobs(c) if self.plan.want_logprobs else None,
                finish_reason=c.finish_reason,
            )
            for c in self.choices
        ]
        return self._response(Completion, choices, usage)

    def _chat_message(self, c: _Choice) -> AssistantMessage:
        echo = self.plan.echo_texts[c.index // self.plan.params.n]
        if c.tools is None:
            return AssistantMessage(content=echo + "".join(c.text_parts))
        c.tools.feed("".join(c.text_parts), final=True)
        return c.tools.message(echo)

    @staticmethod
    def _completion_logprobs(
        c: _Choice, start: int = 0, end: int | None = None
    ) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=c.lp_tokens[start:end],
            token_logprobs=c.lp_values[start:end],
            top_logprobs=c.lp_top[start:end],
            text_offset=c.lp_offsets[start:end],
        )

    async def reply_sse(self, send: Any, deadline: float | None) -> None:
        """Streams chunks, one `send` per engine round; ends with `data: [DONE]`. `deadline`
        (event-loop time) ends it with a 504 error event."""
        try:
            await http.start_sse(send)
            await send(
                {"type": "http.response.body", "body": self._opening_chunks(), "more_body": True}
            )
            async with asyncio.timeout_at(deadline):
                while not self.done:
                    views = await self.next_outputs()
                    payload = self._delta_chunks(views)
                    if payload:
                        await send(
                            {"type": "http.response.body", "body": payload, "more_body": True}
                        )
                    if self.error_reason():
                        self.abort("error")
                        raise StreamClosed("error")
                if self.stream.closed_reason is not None:
                    raise StreamClosed(self.stream.closed_reason)
        except TimeoutError:
            self.abort("timeout")
            return await self._end_sse_with_error(send, "timeout")
        except StreamClosed as closed:
            if closed.reason == "disconnect":
                return
            if closed.reason == "engine_failed":
                self.abort("engine_failed")
            return await self._end_sse_with_error(send, closed.reason)
        except OSError:
            # The socket went away under a send: same as a disconnect.
            self.abort("disconnect")
            return
        tail = b""
        if self.plan.include_usage:
            tail += http.sse_event(http.encode(self._usage_chunk()))
        await send({"type": "http.response.body", "body": tail + http.SSE_DONE, "more_body": False})

    async def _end_sse_with_error(self, send: Any, reason: str) -> None:
        status = _STATUS_OF_CLOSE[reason]
        body = http.error_body(status, self._close_message(reason))
        with contextlib.suppress(OSError):
            await send(
                {
                    "type": "http.response.body",
                    "body": http.sse_event(body) + http.SSE_DONE,
                    "more_body": False,
                }
            )

    def _opening_chunks(self) -> bytes:
        """Chat: the assistant role per choice (and the echoed last message). Completions with
        echo: the prompt text."""
        parts = []
        n = self.plan.params.n
        for c in self.choices:
            if self.plan.chat:
                echo = self.plan.echo_texts[c.index // n]
                chunk = self._chat_chunk(c.index, ChatDelta(role="assistant", content=echo))
            elif self.plan.echo_texts[c.index // n]:
                chunk = self._completion_chunk(c.index, self.plan.echo_texts[c.index // n])
            else:
                continue
            parts.append(http.sse_event(http.encode(chunk)))
        return b"".join(parts)

    @staticmethod
    def _coalesce(views: list[_DeltaView]) -> list[_DeltaView]:
        """One view per choice: several rounds released together become one chunk."""
        merged: dict[int, _DeltaView] = {}
        for view in views:
            first = merged.get(view.index)
            if first is None:
                merged[view.index] = view
            else:
                merged[view.index] = _DeltaView(
                    view.index,
                    first.text + view.text,
                    view.finish_reason or first.finish_reason,
                    first.lp_start,
                    view.lp_end,
                )
        return list(merged.values())

    def _delta_chunks(self, views: list[_DeltaView]) -> bytes:
        parts = []
        for view in self._coalesce(views):
            if view.finish_reason == "error":
                continue
            if not view.text and view.finish_reason is None and view.lp_start == view.lp_end:
                continue  # the detokenizer held text back (partial character, stop prefix)
            c = self.choices[view.index]
            logprobs = None
            if self.plan.want_logprobs:
                if self.plan.chat:
                    logprobs = ChatLogprobs(content=c.chat_lps[view.lp_start : view.lp_end])
                else:
                    logprobs = self._completion_logprobs(c, view.lp_start, view.lp_end)
            if c.tools is not None:
                parts.append(self._tool_chunks(c, view, logprobs))
                continue
            if self.plan.chat:
                chunk = self._chat_chunk(
                    view.index, ChatDelta(content=view.text), view.finish_reason, logprobs
                )
            else:
                chunk = self._completion_chunk(view.index, view.text, view.finish_reason, logprobs)
            parts.append(http.sse_event(http.encode(chunk)))
        return b"".join(parts)

    def _tool_chunks(self, c: _Choice, view: _DeltaView, logprobs: Any) -> bytes:
        """A delta's chunks for a choice whose calls are parsed: its content and call pieces
        (none while the parser holds text back), the finish reason on the last, the delta's
        logprobs on the first."""
        deltas = c.tools.feed(view.text, final=view.finish_reason is not None)
        finish = c.tools.finish_reason(view.finish_reason)
        if not deltas and (finish is not None or logprobs is not None):
            deltas = [ChatDelta()]
        last = len(deltas) - 1
        return b"".join(
            http.sse_event(
                http.encode(
                    self._chat_chunk(
                        view.index,
                        delta,
                        finish if i == last else None,
                        logprobs if i == 0 else None,
                    )
                )
            )
            for i, delta in enumerate(deltas)
        )

    def _response(self, response_type: type, choices: list, usage: Usage | None = None) -> Any:
        """A response or chunk of this generation (its id, creation time and model)."""
        return response_type(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    def _chat_chunk(
        self, index: int, delta: ChatDelta, finish: str | None = None, logprobs: Any = None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self._response(ChatCompletionChunk, [choice])

    def _completion_chunk(
        self, index: int, text: str, finish: str | None = None, logprobs: Any = None
    ) -> Completion:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return self._response(Completion, [choice])

    def _usage_chunk(self) -> ChatCompletionChunk | Completion:
        return self._response(
            ChatCompletionChunk if self.plan.chat else Completion, [], self.usage()
        )
