"""A minimal OpenAI-compatible streaming server for exercising the load generator's HTTP side.

It streams `max_tokens` tokens per request (ignoring EOS, as the load generator asks), a few
tokens per chunk like a speculative server, and counts what it served in a vLLM-schema
`/metrics`, so client-side and server-side token counts can be compared. Each reply's text
names its request, so replies differ. With `prefix_cache` it also counts prefix-cache queries
and hits in words: a prompt hits the longest word prefix it shares with an earlier prompt.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

import uvicorn


@dataclass
class FakeState:
    tokens_per_chunk: int = 3
    chunk_delay_s: float = 0.002
    send_token_ids: bool = True  # False: only text + final usage, like many servers
    valid_keys: tuple[str, ...] = ()  # empty: no auth
    error_after_chunks: int | None = None  # send an in-stream error event after this many
    prefix_cache: bool = False  # expose prefix-cache counters (in words) in /metrics
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompts_seen: list[list[str]] = field(default_factory=list)
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests_ok: int = 0
    bodies: list[dict] = field(default_factory=list)
    keys_seen: list[str] = field(default_factory=list)


class FakeOpenAI:
    def __init__(self, state: FakeState):
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        headers = dict(scope["headers"])
        if path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        elif path == "/metrics":
            await _plain(send, self._metrics())
        elif path in ("/v1/completions", "/v1/chat/completions"):
            auth = headers.get(b"authorization", b"").decode()
            key = auth.removeprefix("Bearer ")
            if self.state.valid_keys and key not in self.state.valid_keys:
                await _json(send, 401, {"error": {"message": "bad key", "type": "auth"}})
                return
            self.state.keys_seen.append(key)
            await self._stream(send, json.loads(body), chat=path.endswith("chat/completions"))
        else:
            await _json(send, 404, {"error": {"message": "not found"}})

    def _metrics(self) -> str:
        s = self.state
        return "\n".join([
            "# TYPE hipfire:generation_tokens_total counter",
            f'hipfire:generation_tokens_total{{model_name="fake-model"}} {s.generation_tokens}',
            f'hipfire:prompt_tokens_total{{model_name="fake-model"}} {s.prompt_tokens}',
            'hipfire:request_success_total{model_name="fake-model",finished_reason="length"} '
            f"{s.requests_ok}",
            *([f"hipfire:prefix_cache_queries_total {s.prefix_cache_queries}",
               f"hipfire:prefix_cache_hits_total {s.prefix_cache_hits}"]
              if s.prefix_cache else []),
            "",
        ])  # fmt: skip

    def _count_prefix_hits(self, req: dict, chat: bool) -> None:
        if chat:
            words = [w for m in req["messages"] for w in (m["role"], *m["content"].split())]
        else:
            words = req["prompt"].split()
        best = 0
        for seen in self.state.prompts_seen:
            n = 0
            while n < min(len(seen), len(words)) and seen[n] == words[n]:
                n += 1
            best = max(best, n)
        self.state.prompts_seen.append(words)
        self.state.prefix_cache_queries += len(words)
        self.state.prefix_cache_hits += best

    async def _stream(self, send, req: dict, chat: bool) -> None:
        self.state.bodies.append(req)
        request_no = len(self.state.bodies)
        if self.state.prefix_cache:
            self._count_prefix_hits(req, chat)
        num_tokens = int(req["max_tokens"])
        prompt = req["messages"][-1]["content"] if chat else req["prompt"]
        num_prompt = len(prompt.split())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        sent = 0
        num_chunks = 0
        while sent < num_tokens:
            if num_chunks == self.state.error_after_chunks:
                await _event(send, {"error": {"message": "engine failed", "type": "server"}})
                await send({"type": "http.response.body", "body": b""})
                return
            num_chunks += 1
            k = min(self.state.tokens_per_chunk, num_tokens - sent)
            ids = list(range(sent, sent + k))
            text = "".join(f" r{request_no}t{i}" for i in ids)
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": None}
            if self.state.send_token_ids:
                choice["token_ids"] = ids
            sent += k
            if sent == num_tokens:
                choice["finish_reason"] = "length"
            await _event(send, {"choices": [choice]})
            await asyncio.sleep(self.state.chunk_delay_s)
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                 "total_tokens": num_prompt + num_tokens}  # fmt: skip
        await _event(send, {"choices": [], "usage": usage})
        self.state.generation_tokens += num_tokens
        self.state.prompt_tokens += num_prompt
        self.state.requests_ok += 1
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _event(send, payload: dict) -> None:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(send, status: int, payload: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _plain(send, text: str) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4")]})  # fmt: skip
    await send({"type": "http.response.body", "body": text.encode()})


class FakeServer:
    """Runs FakeOpenAI with uvicorn on a free loopback port in a background thread."""

    def __init__(self, state: FakeState):
        self.state = state
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(FakeOpenAI(state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("fake server failed to start")
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
