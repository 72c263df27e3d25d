"""The ASGI application: routes, auth, admission, and the drain on shutdown.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
POST /tokenize, POST /detokenize (`tokenization.py`), GET /version, GET /health, GET /metrics;
all but the last three need the API key when keys are set. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.
Order of checks for a generation request: draining (503) -> auth (401) -> body size (413) ->
body shape and values (400) -> model name (404) -> context length (400) -> tenant's speculation
modes (400) -> tenant rate limits (429) -> engine queue (503). A request whose engine is not
serving (failed, restarting: `supervisor.py`) gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import anyio

from hipfire_serve.server import http, tokenization
from hipfire_serve.server.chat_render import render_chat
from hipfire_serve.server.config import ServerConfig
from hipfire_serve.server.engine_client import EngineClient, EngineUnavailable
from hipfire_serve.server.generate import Generation, GenerationPlan, TokenTexts
from hipfire_serve.server.metrics import ServerMetrics
from hipfire_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
    chat_messages,
    check_capacity,
    decode_request,
    prompt_inputs,
    sampling_params,
)
from hipfire_serve.server.request_fields import check_request_fields, truncate_prompt
from hipfire_serve.server.supervisor import EngineSupervisor
from hipfire_serve.server.tenants import RateLimitExceeded, Tenant, TenantRegistry
from hipfire_serve.server.tool_choice import ToolCalling, plan_tools

logger = logging.getLogger("hipfire_serve.server")

# Bodies from this size on are decoded, rendered and tokenized on a worker thread: a prompt of a
# few MiB takes seconds to tokenize, which on the event loop would stall every stream. Smaller
# ones stay on the loop, where they cost less than the hop to a thread.
OFF_LOOP_BODY_BYTES = 32 << 10
# Worker threads for such bodies at once: the tokenizer releases the GIL, so each takes a core
# from the engine; a quarter of the cores keeps most of them for it.
OFF_LOOP_THREADS = max(1, (os.cpu_count() or 1) // 4)

_ROUTES = {
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/version": "GET",
    "/health": "GET",
    "/metrics": "GET",
}
MODEL_ROUTE = "/v1/models/"  # + a model id, which may hold slashes


def server_version() -> str:
    try:
        return importlib.metadata.version("hipfire-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _engine_errors() -> tuple[type, type]:
    from hipfire_serve.engine import ContextLengthError, QueueFullError

    return QueueFullError, ContextLengthError


VERSION_BODY = http.encode({"version": server_version()})


class App:
    def __init__(
        self,
        engine: EngineClient,
        *,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        config: ServerConfig,
        tenants: TenantRegistry,
        metrics: ServerMetrics,
        num_slots: int | None = None,
        max_queue: int | None = None,
        generation_defaults: dict[str, Any] | None = None,
        tool_calling: ToolCalling | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.config = config
        self.tenants = tenants
        self.metrics = metrics
        # The engine's slot pool and queue bound; None: requests are not checked against them.
        self.num_slots = num_slots
        self.max_queue = max_queue
        # sampling defaults of requests that leave a field out (--generation-config)
        self.generation_defaults = dict(generation_defaults or {})
        # --tool-call-parser and the flags beside it, resolved for the served model
        self.tool_calling = tool_calling or ToolCalling()
        self.token_texts = TokenTexts(tokenizer)
        self.created = int(time.time())
        self.draining = False
        self.supervisor: EngineSupervisor | None = None  # started and stopped with the app
        self._plan_limiter: anyio.CapacityLimiter | None = None
        self.live: set[Generation] = set()
        self._queue_full_error, self._context_error = _engine_errors()

    # --- ASGI entry ---

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        response_started = False

        async def tracked_send(message: dict) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        try:
            await self._route(scope, receive, tracked_send)
        except Exception:
            # A bug, not a client error: log it, answer 500 in the API's shape if still possible.
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not response_started:
                await http.send_error(send, 500, "internal server error")

    async def _route(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"].rstrip("/") or "/"
        method = "GET" if path.startswith(MODEL_ROUTE) else _ROUTES.get(path)
        if method is None:
            return await http.send_error(send, 404, f"no route {scope['path']}")
        if scope["method"] != method:
            return await http.send_error(send, 405, f"{path} takes {method}")
        try:
            if path == "/health":
                if self.draining:
                    return await http.send_error(send, 503, "the server is shutting down")
                if not self.engine.serving:
                    fault = self.engine.fault or "the engine loop is not running"
                    return await http.send_error(send, 503, f"the engine is not serving: {fault}")
                return await http.send_bytes(send, 200, b'{"status":"ok"}')
            if path == "/metrics":
                return await http.send_bytes(
                    send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8"
                )
            if path == "/version":
                return await http.send_bytes(send, 200, VERSION_BODY)
            tenant = self.tenants.authenticate(http.header(scope, b"authorization"))
            if tenant is None:
                return await http.send_error(
                    send, 401, "missing or unknown API key", code="invalid_api_key"
                )
            card = ModelCard(
                id=self.model_name, created=self.created, max_model_len=self.max_model_len
            )
            if path == "/v1/models":
                return await http.send_bytes(send, 200, http.encode(ModelList(data=[card])))
            if path.startswith(MODEL_ROUTE):
                if path[len(MODEL_ROUTE) :] != self.model_name:
                    raise RequestError(
                        f"The model {path[len(MODEL_ROUTE) :]!r} does not exist",
                        "model",
                        status=404,
                        code="model_not_found",
                    )
                return await http.send_bytes(send, 200, http.encode(card))
            if path in ("/tokenize", "/detokenize"):
                return await self._tokenization(scope, receive, send, path)
            await self._generate(
                scope, receive, send, tenant, chat=path.endswith("chat/completions")
            )
        except RequestError as exc:
            await http.send_error(send, exc.status, exc.message, exc.param, code=exc.code)
        except http.ClientGone:
            return

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.engine.start()
                if self.supervisor is not None:
                    self.supervisor.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.supervisor is not None:
                    await self.supervisor.stop()
                for generation in list(self.live):
                    generation.abort("shutdown")
                await self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- generation ---

    async def _generate(
        self, scope: dict, receive: Any, send: Any, tenant: Tenant, *, chat: bool
    ) -> None:
        arrival = time.monotonic()
        # --request-timeout counts from arrival: waiting for the engine to take a request in
        # is part of it. Planning on a worker thread is not interrupted (it is bounded by the
        # body size), but its time counts.
        timeout_s = self.config.request_timeout
        deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s else None
        if self.draining:
            return await http.send_error(
                send, 503, "the server is shutting down", retry_after_s=self.config.retry_after
            )
        if not self.engine.serving:
            return await self._send_engine_unavailable(send, self.engine.fault)
        body = await http.read_body(scope, receive, self.config.max_body_bytes)
        plan = await self._plan_request(body, tenant, chat=chat)
        try:
            self.tenants.admit(tenant, plan.max_tokens_charged)
        except RateLimitExceeded as exc:
            return await http.send_error(
                send, 429, exc.message, code="rate_limit_exceeded", retry_after_s=exc.retry_after_s
            )

        def refund(num_tokens: int) -> None:
            self.tenants.refund_tokens(tenant, num_tokens)

        generation = Generation(
            plan,
            engine=self.engine,
            metrics=self.metrics,
            token_texts=self.token_texts,
            model_name=self.model_name,
            tenant=tenant.name,
            arrival=arrival,
            on_tokens_unused=refund,
            stream_interval=self.config.stream_interval,
            retry_after_s=self.config.retry_after,
        )
        self.live.add(generation)
        watcher = asyncio.create_task(_watch_disconnect(receive, generation.abort))
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await generation.submit()
            except TimeoutError:
                refund(plan.max_tokens_charged)
                return await http.send_error(
                    send,
                    504,
                    "request timed out (--request-timeout) waiting for the engine to take it in; "
                    "it was aborted",
                )
            except EngineUnavailable as exc:
                refund(plan.max_tokens_charged)
                return await self._send_engine_unavailable(send, str(exc))
            except self._queue_full_error as exc:
                refund(plan.max_tokens_charged)
                return await http.send_error(
                    send,
                    503,
                    f"the request queue is full ({exc})",
                    retry_after_s=self.config.retry_after,
                )
            except self._context_error as exc:
                refund(plan.max_tokens_charged)
                raise _context_length_error(
                    exc.prompt_len, exc.max_tokens, exc.max_model_len, chat
                ) from None
            except ValueError as exc:
                refund(plan.max_tokens_charged)
                message = str(exc)
                raise RequestError(message, message.split(" ", 1)[0]) from None
            if plan.stream:
                await generation.reply_sse(send, deadline)
            else:
                await generation.reply_json(send, deadline)
        finally:
            watcher.cancel()
            if not generation.done:
                generation.abort("disconnect")
            self.live.discard(generation)

    async def _send_engine_unavailable(self, send: Any, fault: str | None) -> None:
        await http.send_error(
            send,
            503,
            f"the engine is not serving ({fault or 'stopped'}); retry later",
            retry_after_s=self.config.retry_after,
        )

    async def _plan_request(self, body: bytes, tenant: Tenant, *, chat: bool) -> GenerationPlan:
        """`_plan`, on a worker thread for a large body (OFF_LOOP_BODY_BYTES)."""
        return await self._sized(body, functools.partial(self._plan, body, tenant, chat=chat))

    async def _sized(self, body: bytes, work: Callable[[], Any]) -> Any:
        """`work()` on the loop for a small body, on a worker thread for a large one."""
        if len(body) < OFF_LOOP_BODY_BYTES:
            return work()
        if self._plan_limiter is None:
            self._plan_limiter = anyio.CapacityLimiter(OFF_LOOP_THREADS)
        return await anyio.to_thread.run_sync(work, limiter=self._plan_limiter)

    async def _tokenization(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        body = await http.read_body(scope, receive, self.config.max_body_bytes)
        if path == "/tokenize":
            work = functools.partial(
                tokenization.tokenize,
                body,
                self.tokenizer,
                model_name=self.model_name,
                max_model_len=self.max_model_len,
            )
        else:
            work = functools.partial(
                tokenization.detokenize, body, self.tokenizer, model_name=self.model_name
            )
        await http.send_bytes(send, 200, await self._sized(body, work))

    def _plan(self, body: bytes, tenant: Tenant, *, chat: bool) -> GenerationPlan:
        """Decodes and checks a request body (RequestError on anything wrong)."""
        if chat:
            req = decode_request(body, ChatCompletionRequest)
        else:
            req = decode_request(body, CompletionRequest)
        if req.model is not None and req.model != self.model_name:
            raise RequestError(
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                status=404,
            )
        if req.stream_options is not None and not req.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        check_request_fields(req)
        chat_echo = ""
        tools = None
        if chat:
            tools = plan_tools(req, self.tool_calling)
            messages = chat_messages(req.messages)
            try:
                text = render_chat(
                    self.tokenizer,
                    messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    template_kwargs=req.chat_template_kwargs,
                    reasoning_effort=req.reasoning_effort,
                    tools=tools.template_tools if tools is not None else None,
                )
            except RequestError:
                raise
            except Exception as exc:
                raise RequestError(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from None
            prompts: list[str | list[int]] = [text]
            echo = False
            # vLLM's chat echo: the reply repeats a last message of its own role
            if req.echo and messages[-1]["role"] == "assistant":
                chat_echo = messages[-1]["content"]
            if req.top_logprobs is not None and not req.logprobs:
                raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
            if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
                raise RequestError(
                    f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs"
                )
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens
            if max_tokens is None:
                max_tokens = req.max_tokens
        else:
            prompts = prompt_inputs(req.prompt)
            echo = req.echo
            logprobs = req.logprobs
            max_tokens = 16 if req.max_tokens is None else req.max_tokens
            if req.suffix:
                raise RequestError("suffix is not supported", "suffix")
            if echo and logprobs is not None:
                raise RequestError(
                    "echo with logprobs is not supported (prompt logprobs are not computed)",
                    "echo",
                )
        # Rendered chat text already carries its special tokens (BOS included when the template
        # writes one), so chat adds none again unless asked (add_special_tokens, vLLM's).
        token_ids = [
            truncate_prompt(
                self._encode(
                    p, "messages" if chat else "prompt", add_special_tokens=req.add_special_tokens
                ),
                req.truncate_prompt_tokens,
                self.max_model_len,
            )
            for p in prompts
        ]
        longest = max(len(ids) for ids in token_ids)
        if max_tokens is None:
            # Chat without a limit: up to the end of the context, as OpenAI does.
            max_tokens = max(1, self.max_model_len - longest)
        cap = self.generation_defaults.get("max_tokens")
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        if max_tokens >= 1 and longest + max_tokens > self.max_model_len:
            raise _context_length_error(longest, max_tokens, self.max_model_len, chat)
        params = sampling_params(
            req, max_tokens=max_tokens, logprobs=logprobs, defaults=self.generation_defaults
        )
        if tools is not None and tools.constraint is not None:
            # tool_choice required or named: the grammar of the calls (plan_tools refused any
            # other constraint beside it)
            params.structured_outputs = tools.constraint
        if self.num_slots is not None and self.max_queue is not None:
            check_capacity(
                len(token_ids), params.n, num_slots=self.num_slots, max_queue=self.max_queue
            )
        try:
            params.speculation = tenant.speculation_mode(params.speculation)
        except ValueError as exc:
            raise RequestError(str(exc), "speculation") from None
        echo_texts = [chat_echo] if chat else [self._echo_text(p) if echo else "" for p in prompts]
        charged = sum(len(ids) for ids in token_ids) + max_tokens * params.n * len(token_ids)
        return GenerationPlan(
            chat=chat,
            prompt_token_ids=token_ids,
            echo_texts=echo_texts,
            params=params,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            want_logprobs=logprobs is not None,
            max_tokens_charged=charged,
            request_id=req.request_id,
            tokens_as_ids=req.return_tokens_as_token_ids,
            tools=tools,
        )

    def _encode(
        self, prompt: str | list[int], param: str, *, add_special_tokens: bool
    ) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            token_ids = prompt
        if not token_ids:
            raise RequestError(f"{param} is empty (no tokens)", param)
        # The tokenizer and the decoder give lists already: a copy of a long one costs ms.
        return token_ids if isinstance(token_ids, list) else list(token_ids)

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    # --- shutdown ---

    async def drain(self, deadline_s: float, on_done: Callable[[], None]) -> None:
        """Stops taking requests (503), waits for in-flight ones up to `deadline_s`, aborts
        the rest, lets their replies go out, then calls `on_done`."""
        self.draining = True
        logger.info(
            "draining: %d request(s) in flight, deadline %.1f s", len(self.live), deadline_s
        )
        end = time.monotonic() + deadline_s
        while self.live and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if self.live:
            logger.info("drain deadline reached: aborting %d request(s)", len(self.live))
            for generation in list(self.live):
                generation.abort("shutdown")
            # Let the handlers write their 503 / final SSE event.
            give_up = time.monotonic() + 2.0
            while self.live and time.monotonic() < give_up:
                await asyncio.sleep(0.01)
        on_done()


def _context_length_error(
    prompt_len: int, max_tokens: int, max_model_len: int, chat: bool
) -> RequestError:
    where = "messages" if chat else "prompt"
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} for the "
        "completion). Please reduce the length of the prompt or max_tokens.",
        "max_tokens" if prompt_len < max_model_len else where,
        code="context_length_exceeded",
    )


async def _watch_disconnect(receive: Any, on_gone: Callable[[str], None]) -> None:
    """Waits for the client to go away (ASGI `http.disconnect`) and aborts its request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone("disconnect")
            return
