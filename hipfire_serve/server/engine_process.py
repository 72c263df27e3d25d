"""The engine loop in a child process (`--engine-loop process`).

Same commands and per-round `RoundBatch` as the thread loop (`async_engine.py`), but the engine
runs in its own process, so its Python work never waits for the event loop's hold on the GIL
and vice versa. The price: each round's batch is serialized (msgpack) across a pipe, and the
server process loads its own copy of the tokenizer. `docs/perf/server.md` compares the two loops.

The child ignores SIGINT and SIGTERM (a terminal's Ctrl+C reaches the whole process group, and
systemd signals the whole control group): the parent's drain decides when requests end, then
tells the child to stop. The child never outlives the server (`lifeline.py`).

A failed child (it exited, or the supervisor found it stalled and killed it) is replaced by
`restart`: a fresh child loads the engine while the server answers 503; requests of the old one
have already been failed.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec

from hipfire_serve.config import EngineConfig
from hipfire_serve.server.engine_client import (
    EngineClient,
    EngineUnavailable,
    ServedStats,
    startup_batch,
    with_served_stats,
)
from hipfire_serve.server.engine_loop import (
    AbortCommand,
    AddCommand,
    EngineDriver,
    RoundBatch,
    StatsCommand,
)
from hipfire_serve.server.lifeline import watch_parent

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


def _child_main(config: EngineConfig, tenant_specs: list, conn, lifeline, parent_pid: int) -> None:
    watch_parent(lifeline, parent_pid)
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
        conn.send_bytes(encoder.encode(startup_batch(engine)))
        while True:
            if not driver.has_work() and not conn.poll(1.0):
                continue
            while conn.poll(0):
                command = decoder.decode(conn.recv_bytes())
                if isinstance(command, StopCommand):
                    return
                driver.apply(command)
            batch = with_served_stats(driver.run_round(), engine)
            if batch is not None:
                conn.send_bytes(encoder.encode(batch))
    except (EOFError, OSError):
        return  # the server went away


# --- parent ------------------------------------------------------------------------------------


class _Child:
    """One engine child process: its pipe, the lifeline it watches, and the writer thread that
    keeps pipe writes (which block while the child is inside a round) off the event loop."""

    def __init__(self, ctx: Any, config: EngineConfig, tenant_specs: list) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        child_lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child_main,
            args=(config, tenant_specs, child_conn, child_lifeline, os.getpid()),
            name="hipfire-engine",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        child_lifeline.close()
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)

    def wait_ready(self) -> Ready:
        """Blocks until the engine is loaded; ValueError with the child's reason if not."""
        try:
            first = msgspec.msgpack.decode(self.conn.recv_bytes(), type=Ready | Failed)
        except (EOFError, OSError):
            self.proc.join(timeout=10)
            raise ValueError(
                f"the engine process exited while starting (status {self.proc.exitcode})"
            ) from None
        if isinstance(first, Failed):
            self.proc.join(timeout=10)
            raise ValueError(first.message)
        return first

    def start_writer(self) -> None:
        self._writer.start()

    def _write_loop(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()

    def close(self) -> None:
        """Stops the writer; the pipes close with this object."""
        self.outbox.put(None)


class ProcessEngine(EngineClient):
    """The app's engine loop with the engine in a child process."""

    def __init__(self, config: EngineConfig, tenant_specs: Sequence = ()) -> None:
        from hipfire_serve.tokenizer import Tokenizer

        super().__init__()
        self._config = config
        self._tenant_specs = list(tenant_specs)
        self._ctx = mp.get_context("spawn")
        self._child = _Child(self._ctx, config, self._tenant_specs)
        # multiprocessing joins its children at exit, and this one ignores SIGTERM: an exit that
        # skipped `stop` would wait on it forever.
        atexit.register(_kill_at_exit, weakref.ref(self))
        first = self._child.wait_ready()
        self.model_name = first.model_name
        self.max_model_len = first.max_model_len
        self.tokenizer = Tokenizer.from_dir(first.tokenizer_dir)
        self._decoder = msgspec.msgpack.Decoder(RoundBatch[ServedStats])
        self._encoder = msgspec.msgpack.Encoder()
        self._attached = False
        self._stopped = False

    def _send(self, command: Any) -> None:
        self._child.outbox.put(self._encoder.encode(command))

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._attach()

    def _attach(self) -> None:
        self._child.start_writer()
        self._loop.add_reader(self._child.conn.fileno(), self._on_readable)
        self._attached = True

    def _detach(self) -> None:
        if self._attached:
            self._attached = False
            self._loop.remove_reader(self._child.conn.fileno())
            self._child.close()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        child = self._child
        if self.fault is None and self._attached:
            self._send(StopCommand())
        else:
            child.kill()
        self._detach()
        await asyncio.to_thread(child.proc.join, 30)
        child.kill()
        self._end_everything("shutdown", EngineUnavailable("the server is shutting down"))

    @property
    def running(self) -> bool:
        return not self._stopped and self._attached and self._child.proc.exitcode is None

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._child.proc.pid

    def kill(self) -> None:
        self._child.kill()

    def fail(self, message: str) -> None:
        # A stalled child may hold a half-sent batch or come back later: it is killed, not asked.
        self._detach()
        self._child.kill()
        super().fail(message)

    @property
    def can_restart(self) -> bool:
        return not self._stopped

    async def restart(self) -> None:
        """A fresh child in place of the failed one; ValueError if it cannot start."""
        old = self._child
        old.kill()
        await asyncio.to_thread(old.proc.join, 10)
        logger.warning(
            "engine process %d ended with status %s; starting a fresh one",
            old.proc.pid,
            old.proc.exitcode,
        )
        # Started from the event-loop thread, which lives as long as the server (`lifeline.py`).
        child = _Child(self._ctx, self._config, self._tenant_specs)
        self._child = child
        try:
            await asyncio.to_thread(child.wait_ready)
        except BaseException:
            child.kill()
            raise
        if self._stopped:
            child.kill()
            return
        self._attach()
        self.fault = None

    def _on_readable(self) -> None:
        conn = self._child.conn
        try:
            while conn.poll():
                self._deliver(self._decoder.decode(conn.recv_bytes()))
        except (EOFError, OSError):
            self._detach()
            self.report_fault("the engine process exited")


def _kill_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.kill()
