"""The event-loop side of an engine loop, shared by the thread and the process loop.

`EngineClient` routes requests: it sends commands to the engine side (`engine_loop.py`), keeps
each request's `RequestStream`, and applies each round's `RoundBatch`: add outcomes to their
waiters, outputs to their streams, stats to the metrics. A subclass supplies only the transport
(`_send`, `start`, `stop`, `running`) and calls `_deliver` with every batch that arrives. All
methods run on the event loop.

It also keeps what the supervisor (`supervisor.py`) judges the engine by: a fault the transport
reported (the thread died, the child exited), and when the engine last showed progress while
something waited on it. `fail` ends everything waiting on a failed engine at once.

The engine side of both loops sends `ServedStats` (`with_served_stats`, `startup_batch`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from hipfire_serve.round_stats import EngineStats
from hipfire_serve.server.engine_loop import (
    AbortCommand,
    AddCommand,
    RoundBatch,
    StatsCommand,
    add_error,
)
from hipfire_serve.types import RequestOutput, SamplingParams

logger = logging.getLogger("hipfire_serve.server")


class ServedStats(EngineStats, kw_only=True):
    """`Engine.stats()` with what the metrics take from the scheduler's prefix cache: its
    block size and whether it is on, and the totals since the engine started of context
    tokens looked up at admission and found cached, per tenant (requests resumed after
    preemption apart, summed over tenants)."""

    block_size: int = 0
    enable_prefix_caching: bool = False
    prefix_cache_queries: dict[str, int] = msgspec.field(default_factory=dict)
    prefix_cache_hits: dict[str, int] = msgspec.field(default_factory=dict)
    prefix_cache_resumed_queries: int = 0
    prefix_cache_resumed_hits: int = 0


def with_served_stats(batch: RoundBatch | None, engine: Any) -> RoundBatch | None:
    """`batch` with its stats made `ServedStats`; on the engine side, between rounds. An
    engine without a scheduler (a test double) keeps its own stats."""
    scheduler = getattr(engine, "scheduler", None)
    if batch is None or batch.stats is None or scheduler is None:
        return batch
    s = scheduler.stats
    batch.stats = ServedStats(
        **{name: getattr(batch.stats, name) for name in EngineStats.__struct_fields__},
        block_size=scheduler.kv.block_size,
        enable_prefix_caching=s.enable_prefix_caching,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        prefix_cache_resumed_queries=s.prefix_cache_resumed_queries,
        prefix_cache_resumed_hits=s.prefix_cache_resumed_hits,
    )
    return batch


def startup_batch(engine: Any) -> RoundBatch:
    """What the engine side sends first, before any round: the engine's stats, so the metrics
    know its slots, KV blocks and prefix cache from start-up (and a fresh child's totals
    start from 0 where the metrics can see it)."""
    batch = RoundBatch(replies=[], outputs=[], stats=engine.stats(), stats_calls=[])
    return with_served_stats(batch, engine)


class EngineUnavailable(Exception):
    """The engine is not serving: it failed (died or stalled), is restarting, or has stopped.
    Clients get 503 with Retry-After."""


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
    """Hands one round's outputs to their streams."""
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


class EngineClient(abc.ABC):
    """The app's engine loop as the event loop sees it; subclasses say where the engine runs."""

    def __init__(self) -> None:
        self.on_round: Callable[[Any], None] | None = None
        self.num_rounds = 0  # rounds the engine stepped (benchmarks and tests)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._next_call_id = 0
        self.fault: str | None = None  # why the engine is not serving now (None: it is)
        self.last_fault: str | None = None  # the latest fault, kept after a restart
        self.on_fault: Callable[[], None] | None = None  # wakes the supervisor
        self.last_stats: Any = None  # the latest engine stats (slot capacity for resets)
        self._progress_at = time.monotonic()  # last batch, or when work started waiting

    # --- transport, supplied by the subclass ---

    @abc.abstractmethod
    def _send(self, command: Any) -> None:
        """Hands one command to the engine side without blocking the event loop."""

    @property
    @abc.abstractmethod
    def running(self) -> bool:
        """Whether the engine side is alive and taking commands."""

    @property
    def can_restart(self) -> bool:
        """Whether `restart` can replace a failed engine (the process loop)."""
        return False

    async def restart(self) -> None:
        """Replaces a failed engine with a fresh one and clears the fault."""
        raise NotImplementedError

    def kill(self) -> None:
        """Ends the engine side at once where that is possible (a child process)."""
        return None  # a thread cannot be killed

    @property
    def serving(self) -> bool:
        return self.fault is None and self.running

    # --- health, for the supervisor ---

    def report_fault(self, message: str) -> None:
        """The transport saw the engine fail; the supervisor takes it from here."""
        if self.fault is None:
            self.fault = self.last_fault = message
        if self.on_fault is not None:
            self.on_fault()

    @property
    def num_waiting_on_engine(self) -> int:
        """Adds, streams and calls that wait for the engine."""
        return len(self._adds) + len(self._streams) + len(self._calls)

    @property
    def progress_at(self) -> float:
        """When the engine last delivered a batch, or when work started waiting on it."""
        return self._progress_at

    def _note_waiting(self) -> None:
        # Idle time is no stall: the clock starts when the first waiter arrives.
        if not self.num_waiting_on_engine:
            self._progress_at = time.monotonic()

    def fail(self, message: str) -> None:
        """Marks the engine failed and ends everything waiting on it: adds and calls raise
        EngineUnavailable, streams close with `engine_failed`."""
        if self.fault is None:
            self.fault = self.last_fault = message
        self._end_everything("engine_failed", EngineUnavailable(message))

    def _end_everything(self, reason: str, error: Exception) -> None:
        """Closes every stream with `reason` and fails every add and call with `error`."""
        futures = [*self._adds.values(), *self._calls.values()]
        self._calls.clear()
        for future in futures:
            if not future.done():
                future.set_exception(error)
        self._fail_all(reason)

    # --- requests ---

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
        if not self.serving:
            raise EngineUnavailable(self.fault or "the engine loop is not running")
        self._note_waiting()
        future = self._loop.create_future()
        self._adds[request_id] = future
        self._streams[request_id] = stream
        self._send(AddCommand(request_id, prompt, params, tenant, arrival_time))
        try:
            return await future
        except BaseException:
            self._streams.pop(request_id, None)
            if not future.done():
                # Cancelled while queued: make sure the engine lets go of it.
                self.abort(request_id)
            raise
        finally:
            self._adds.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stops delivering to `request_id` now; the engine frees it in its next round."""
        self._streams.pop(request_id, None)
        if self.serving:  # a failed engine's requests went with it
            self._send(AbortCommand(request_id))

    async def stats(self) -> Any:
        """`Engine.stats()` as of the next round (the snapshot the metrics get too)."""
        return await self._ask(StatsCommand)

    async def _ask(self, make_command: Callable[[int], Any]) -> Any:
        """Sends `make_command(call_id)`; returns the answer the engine side gives that id."""
        if not self.serving:
            raise EngineUnavailable(self.fault or "the engine loop is not running")
        self._note_waiting()
        call_id = self._next_call_id
        self._next_call_id += 1
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(make_command(call_id))
        return await future

    # --- delivery ---

    def _deliver(self, batch: RoundBatch) -> None:
        """Applies one round's batch: add outcomes, outputs, answers, metrics."""
        now = time.monotonic()
        self._progress_at = now
        for reply in batch.replies:
            future = self._adds.get(reply.request_id)
            if future is None or future.done():
                continue
            error = add_error(reply)
            if error is None:
                future.set_result(reply.taken_at)
            else:
                future.set_exception(error)
        if batch.failed:
            self._fail_all("error")
        deliver_outputs(self._streams, batch.outputs, now)
        for call_id in batch.stats_calls:
            self._answer(call_id, batch.stats, None)
        for answer in batch.call_answers:
            self._answer(answer.call_id, answer.value, answer.error)
        if batch.stepped:
            self.num_rounds += 1
        if batch.stats is not None:
            self.last_stats = batch.stats
        if batch.stats is not None and self.on_round is not None:
            try:
                self.on_round(batch.stats)
            except Exception:
                logger.exception("metrics update failed")

    def _answer(self, call_id: int, value: Any, error: Exception | None) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def _fail_all(self, reason: str) -> None:
        """Closes every open stream with `reason` (shutdown, or the engine failed)."""
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.close(reason)
