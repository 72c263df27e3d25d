"""The engine loop: a dedicated thread drives the synchronous `Engine`, the event loop serves HTTP.

Why a thread: `Engine` is not thread-safe and its rounds are long, blocking calls; running them
on the event loop would stall every connection for a round. The thread owns the engine outright:
requests and aborts reach it through a command queue, and each round's results go back to the
event loop in one `call_soon_threadsafe` batch (outputs of all requests, the `add_request`
outcomes and the engine's stats), so the cost of crossing threads is paid per round, not per
token. (`docs/server.md` records the measurement behind choosing a thread over a process.)

Commands are applied between rounds, so an abort frees its slot and KV in the next round.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hipfire_serve.types import RequestOutput, SamplingParams

logger = logging.getLogger("hipfire_serve.server")


class StreamClosed(Exception):
    """The server ended a request on its own (disconnect, timeout, shutdown, engine failure)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RequestStream:
    """Deltas of the engine requests behind one HTTP request, batched per round.

    One HTTP request may own several engine requests (a list of prompts); they share one stream
    so the handler wakes once per round however many prompts advanced. With `wake_every > 1`
    the handler wakes only every that many rounds (and at the end), so a stream is written less
    often: fewer socket writes and client wake-ups per token, at some token latency. Each delta
    keeps the time its round was delivered, so latency metrics do not depend on the wake-ups.
    """

    def __init__(self, wake_every: int = 1) -> None:
        self._pending: list[tuple[RequestOutput, float]] = []
        self._ready = asyncio.Event()
        self._wake_every = wake_every
        self._rounds_held = 0
        self._finish_held = False
        self.closed_reason: str | None = None

    def push(self, output: RequestOutput, delivered_at: float) -> None:
        self._pending.append((output, delivered_at))
        if output.finished:
            self._finish_held = True

    def end_round(self) -> None:
        """Called once per delivered round in which this stream got outputs."""
        self._rounds_held += 1
        if self._rounds_held >= self._wake_every or self._finish_held:
            self._rounds_held = 0
            self._finish_held = False
            self._ready.set()

    def close(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
        self._ready.set()

    async def next_batch(self) -> list[tuple[RequestOutput, float]]:
        """Everything released since the last call, with delivery times; raises StreamClosed
        once closed (after the outputs that arrived before closing have been handed out)."""
        while True:
            if self._ready.is_set() and self._pending:
                break
            if self.closed_reason is not None:
                if self._pending:
                    break
                raise StreamClosed(self.closed_reason)
            self._ready.clear()
            await self._ready.wait()
        self._ready.clear()
        batch, self._pending = self._pending, []
        return batch


def deliver_outputs(
    streams: dict[str, RequestStream], outputs: list[RequestOutput], delivered_at: float
) -> None:
    """Hands one round's outputs to their streams (event-loop thread)."""
    touched: dict[int, RequestStream] = {}
    for output in outputs:
        stream = streams.get(output.request_id)
        if stream is None:
            continue  # aborted here already
        stream.push(output, delivered_at)
        touched[id(stream)] = stream
        if output.finished:
            del streams[output.request_id]
    for stream in touched.values():
        stream.end_round()


class AsyncEngine:
    """Drives one `Engine` from a thread; the methods below are for the event loop only."""

    def __init__(
        self,
        engine: Any,
        *,
        on_round: Callable[[Any], None] | None = None,
        idle_poll_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.on_round = on_round
        self._idle_poll_s = idle_poll_s
        self._commands: collections.deque[tuple] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._engine_live: set[str] = set()  # engine-thread view: added, not finished/aborted
        self.num_rounds = 0  # rounds stepped (read from the event loop; benchmark and tests)

    # --- event-loop side ---

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hipfire-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for stream in set(self._streams.values()):
            stream.close("shutdown")
        self._streams.clear()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: RequestStream,
        *,
        tenant: str,
        arrival_time: float,
    ) -> float:
        """Hands a request to the engine; returns the monotonic time the engine took it in.
        Raises what `Engine.add_request` raises (QueueFullError, ContextLengthError,
        ValueError)."""
        if not self.running:
            raise RuntimeError("the engine loop is not running")
        future = self._loop.create_future()
        self._streams[request_id] = stream
        self._commands.append(("add", request_id, prompt, params, tenant, arrival_time, future))
        self._wake.set()
        try:
            return await future
        except BaseException:
            self._streams.pop(request_id, None)
            if not future.done():
                # Cancelled while queued: make sure the engine lets go of it.
                self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stops delivering to `request_id` now; the engine frees it in its next round."""
        self._streams.pop(request_id, None)
        self._commands.append(("abort", request_id))
        self._wake.set()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(engine)` in the engine thread between rounds (tests and diagnostics)."""
        future = self._loop.create_future()
        self._commands.append(("call", fn, future))
        self._wake.set()
        return await future

    async def stats(self) -> Any:
        """`Engine.stats()` taken between rounds (drains the round records it returns)."""
        return await self.call(lambda engine: engine.stats())

    def _deliver(self, replies: list, outputs: list[RequestOutput], stats: Any) -> None:
        for future, value, exc in replies:
            if future.done():
                continue
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)
        deliver_outputs(self._streams, outputs, time.monotonic())
        if stats is not None and self.on_round is not None:
            try:
                self.on_round(stats)
            except Exception:
                logger.exception("metrics update failed")

    def _fail_all(self, reason: str) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.close(reason)

    # --- engine-thread side ---

    def _run(self) -> None:
        engine = self.engine
        loop = self._loop
        while not self._stopping:
            replies = self._apply_commands()
            outputs: list[RequestOutput] = []
            stepped = False
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                    stepped = True
                    self.num_rounds += 1
                except Exception:
                    # The engine fails a round's requests itself; reaching here means its own
                    # bookkeeping broke. Abort and fail everything in flight rather than hang
                    # clients or retry the same broken round forever.
                    logger.exception("engine step failed; aborting in-flight requests")
                    for request_id in self._engine_live:
                        self._abort_in_engine(request_id)
                    self._engine_live.clear()
                    loop.call_soon_threadsafe(self._fail_all, "error")
                    time.sleep(0.05)
                for output in outputs:
                    if output.finished:
                        self._engine_live.discard(output.request_id)
            stats = engine.stats() if (stepped or replies) else None
            if replies or outputs or stats is not None:
                loop.call_soon_threadsafe(self._deliver, replies, outputs, stats)
            self._wake.clear()
            if not self._commands and not engine.has_unfinished():
                self._wake.wait(self._idle_poll_s)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def _apply_commands(self) -> list[tuple]:
        replies: list[tuple] = []
        engine = self.engine
        while self._commands:
            command = self._commands.popleft()
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, tenant, arrival_time, future = command
                try:
                    engine.add_request(
                        request_id, prompt, params, tenant=tenant, arrival_time=arrival_time
                    )
                    self._engine_live.add(request_id)
                    replies.append((future, time.monotonic(), None))
                except Exception as exc:
                    replies.append((future, None, exc))
            elif kind == "abort":
                self._engine_live.discard(command[1])
                self._abort_in_engine(command[1])
            else:
                _, fn, future = command
                try:
                    replies.append((future, fn(engine), None))
                except Exception as exc:
                    replies.append((future, None, exc))
        return replies
