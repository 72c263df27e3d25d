"""The engine loop in a child process (`--engine-loop process`).

Same contract as `AsyncEngine` (commands in, one batch per round out), but the engine runs in
its own process, so its Python work never waits for the event loop's hold on the GIL and vice
versa. The price: each round's outputs are serialized (msgpack) across a pipe, and the server
process loads its own copy of the tokenizer. `docs/perf/server.md` compares the two loops.

Wire format: msgspec tagged Structs over a `multiprocessing` pipe. The child ignores SIGINT and
SIGTERM (a terminal's Ctrl+C reaches the whole process group): the parent's drain decides when
requests end, then tells the child to stop. The child exits by itself when the pipe closes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from hipfire_serve.config import EngineConfig
from hipfire_serve.engine import EngineStats
from hipfire_serve.server.async_engine import RequestStream, deliver_outputs
from hipfire_serve.types import RequestOutput, SamplingParams

logger = logging.getLogger("hipfire_serve.server")


class AddCommand(msgspec.Struct, tag="add"):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    tenant: str
    arrival_time: float


class AbortCommand(msgspec.Struct, tag="abort"):
    request_id: str


class StatsCommand(msgspec.Struct, tag="stats"):
    call_id: int


class StopCommand(msgspec.Struct, tag="stop"):
    pass


Command = AddCommand | AbortCommand | StatsCommand | StopCommand


class AddReply(msgspec.Struct):
    request_id: str
    error: str | None = None  # "queue_full" | "context_length" | "value" | "internal"
    message: str = ""
    numbers: list[int] = []  # ContextLengthError: prompt_len, max_tokens, max_model_len


class Ready(msgspec.Struct, tag="ready"):
    model_name: str
    max_model_len: int
    tokenizer_dir: str


class Failed(msgspec.Struct, tag="failed"):
    message: str


class RoundBatch(msgspec.Struct, tag="round"):
    replies: list[AddReply]
    outputs: list[RequestOutput]
    stats: EngineStats | None
    stats_calls: list[tuple[int, EngineStats]]
    failed: bool = False  # step() itself raised: every request in flight was aborted


# --- child -------------------------------------------------------------------------------------


def _child_main(config: EngineConfig, tenant_specs: list, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Command)
    try:
        from hipfire_serve.engine import (
            ContextLengthError,
            Engine,
            QueueFullError,
            resolve_model_dirs,
        )

        engine = Engine(config, tenants=tenant_specs)
        target_dir = str(resolve_model_dirs(config)[0])
    except Exception as exc:
        conn.send_bytes(encoder.encode(Failed(message=str(exc))))
        return
    conn.send_bytes(encoder.encode(Ready(engine.model_name, engine.max_model_len, target_dir)))
    live: set[str] = set()
    try:
        while True:
            busy = engine.has_unfinished()
            if not busy and not conn.poll(1.0):
                continue
            replies: list[AddReply] = []
            stats_calls: list[int] = []
            while conn.poll(0):
                command = decoder.decode(conn.recv_bytes())
                if isinstance(command, AddCommand):
                    reply = AddReply(command.request_id)
                    try:
                        engine.add_request(
                            command.request_id,
                            command.prompt,
                            command.params,
                            tenant=command.tenant,
                            arrival_time=command.arrival_time,
                        )
                        live.add(command.request_id)
                    except QueueFullError as exc:
                        reply.error, reply.message = "queue_full", str(exc)
                    except ContextLengthError as exc:
                        reply.error, reply.message = "context_length", str(exc)
                        reply.numbers = [exc.prompt_len, exc.max_tokens, exc.max_model_len]
                    except ValueError as exc:
                        reply.error, reply.message = "value", str(exc)
                    except Exception as exc:
                        reply.error, reply.message = "internal", str(exc)
                    replies.append(reply)
                elif isinstance(command, AbortCommand):
                    live.discard(command.request_id)
                    engine.abort(command.request_id)
                elif isinstance(command, StatsCommand):
                    stats_calls.append(command.call_id)
                else:
                    return
            outputs: list[RequestOutput] = []
            stepped = failed = False
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                    stepped = True
                except Exception:
                    logger.exception("engine step failed; aborting in-flight requests")
                    for request_id in live:
                        engine.abort(request_id)
                    live.clear()
                    failed = True
                for output in outputs:
                    if output.finished:
                        live.discard(output.request_id)
            stats = engine.stats() if (stepped or replies or stats_calls) else None
            calls = [(call_id, stats) for call_id in stats_calls]
            if replies or outputs or stats is not None or failed:
                batch = RoundBatch(replies, outputs, stats, calls, failed)
                conn.send_bytes(encoder.encode(batch))
    except (EOFError, OSError):
        return  # the server went away


# --- parent ------------------------------------------------------------------------------------


class ProcessEngine:
    """The app's engine loop with the engine in a child process (interface of AsyncEngine)."""

    is_engine_loop = True  # build_server uses it as is (a bare Engine gets an AsyncEngine)

    def __init__(self, config: EngineConfig, tenant_specs: Sequence = ()) -> None:
        from hipfire_serve.engine import ContextLengthError, QueueFullError
        from hipfire_serve.tokenizer import Tokenizer

        self._errors = {"queue_full": QueueFullError, "context_length": ContextLengthError}
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main,
            args=(config, list(tenant_specs), child_conn),
            name="hipfire-engine",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        first = msgspec.msgpack.decode(self._conn.recv_bytes(), type=Ready | Failed)
        if isinstance(first, Failed):
            self._proc.join(timeout=10)
            raise ValueError(first.message)
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.tokenizer = Tokenizer.from_dir(first.tokenizer_dir)
        self.on_round: Callable[[Any], None] | None = None
        self.num_rounds = 0
        self._decoder = msgspec.msgpack.Decoder(RoundBatch)
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._stats_calls: dict[int, asyncio.Future] = {}
        self._next_call = 0
        self._stopped = False

    def _write_loop(self) -> None:
        # Pipe writes can block while the child is inside a round: never on the event loop.
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                return

    def _send(self, command: Any) -> None:
        self._outbox.put(self._encoder.encode(command))

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer.start()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._send(StopCommand())
        self._outbox.put(None)
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        await asyncio.to_thread(self._proc.join, 30)
        if self._proc.is_alive():
            self._proc.kill()
        self._fail_all("shutdown")

    @property
    def running(self) -> bool:
        return not self._stopped and self._proc.is_alive()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._proc.pid

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
        if not self.running:
            raise RuntimeError("the engine process is not running")
        future = self._loop.create_future()
        self._adds[request_id] = future
        self._streams[request_id] = stream
        self._send(AddCommand(request_id, prompt, params, tenant, arrival_time))
        try:
            return await future
        except BaseException:
            self._streams.pop(request_id, None)
            if not future.done():
                self.abort(request_id)
            raise
        finally:
            self._adds.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._send(AbortCommand(request_id))

    async def stats(self) -> Any:
        call_id = self._next_call
        self._next_call += 1
        future = self._loop.create_future()
        self._stats_calls[call_id] = future
        self._send(StatsCommand(call_id))
        return await future

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._deliver(self._decoder.decode(self._conn.recv_bytes()))
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            logger.error("the engine process exited")
            self._fail_all("error")

    def _deliver(self, batch: RoundBatch) -> None:
        now = time.monotonic()
        for reply in batch.replies:
            future = self._adds.get(reply.request_id)
            if future is None or future.done():
                continue
            if reply.error is None:
                future.set_result(now)
            elif reply.error == "context_length":
                future.set_exception(self._errors["context_length"](*reply.numbers))
            elif reply.error in self._errors:
                future.set_exception(self._errors[reply.error](reply.message))
            elif reply.error == "value":
                future.set_exception(ValueError(reply.message))
            else:
                future.set_exception(RuntimeError(reply.message))
        if batch.failed:
            self._fail_all("error")
        deliver_outputs(self._streams, batch.outputs, now)
        for call_id, stats in batch.stats_calls:
            future = self._stats_calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(stats)
        if batch.stats is not None:
            self.num_rounds += len(batch.stats.rounds)
            if self.on_round is not None:
                try:
                    self.on_round(batch.stats)
                except Exception:
                    logger.exception("metrics update failed")

    def _fail_all(self, reason: str) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.close(reason)
