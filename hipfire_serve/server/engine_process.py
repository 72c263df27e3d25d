"""The engine loop in a child process (`--engine-loop process`).

Same commands and per-round `RoundBatch` as the thread loop (`async_engine.py`), but the engine
runs in its own process, so its Python work never waits for the event loop's hold on the GIL
and vice versa. The price: each round's batch is serialized (msgpack) across a pipe, and the
server process loads its own copy of the tokenizer. `docs/perf/server.md` compares the two loops.

The child ignores SIGINT and SIGTERM (a terminal's Ctrl+C reaches the whole process group): the
parent's drain decides when requests end, then tells the child to stop. The child exits by
itself when the pipe closes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from hipfire_serve.config import EngineConfig
from hipfire_serve.engine import EngineStats
from hipfire_serve.server.engine_client import EngineClient
from hipfire_serve.server.engine_loop import (
    AbortCommand,
    AddCommand,
    EngineDriver,
    RoundBatch,
    StatsCommand,
)

logger = logging.getLogger("hipfire_serve.server")


class StopCommand(msgspec.Struct, tag="stop"):
    pass


Command = AddCommand | AbortCommand | StatsCommand | StopCommand


class Ready(msgspec.Struct, tag="ready"):
    model_name: str
    max_model_len: int
    tokenizer_dir: str


class Failed(msgspec.Struct, tag="failed"):
    message: str


# --- child -------------------------------------------------------------------------------------


def _child_main(config: EngineConfig, tenant_specs: list, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(Command)
    try:
        from hipfire_serve.engine import Engine
        from hipfire_serve.engine_setup import resolve_model_dirs

        engine = Engine(config, tenants=tenant_specs)
        target_dir = str(resolve_model_dirs(config)[0])
    except Exception as exc:
        conn.send_bytes(encoder.encode(Failed(message=str(exc))))
        return
    conn.send_bytes(encoder.encode(Ready(engine.model_name, engine.max_model_len, target_dir)))
    driver = EngineDriver(engine)
    try:
        while True:
            if not driver.has_work() and not conn.poll(1.0):
                continue
            while conn.poll(0):
                command = decoder.decode(conn.recv_bytes())
                if isinstance(command, StopCommand):
                    return
                driver.apply(command)
            batch = driver.run_round()
            if batch is not None:
                conn.send_bytes(encoder.encode(batch))
    except (EOFError, OSError):
        return  # the server went away


# --- parent ------------------------------------------------------------------------------------


class ProcessEngine(EngineClient):
    """The app's engine loop with the engine in a child process."""

    def __init__(self, config: EngineConfig, tenant_specs: Sequence = ()) -> None:
        from hipfire_serve.tokenizer import Tokenizer

        super().__init__()
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
        self._decoder = msgspec.msgpack.Decoder(RoundBatch[EngineStats])
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
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

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._deliver(self._decoder.decode(self._conn.recv_bytes()))
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            logger.error("the engine process exited")
            self._fail_all("error")
