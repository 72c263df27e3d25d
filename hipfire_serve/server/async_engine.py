"""The engine loop in a dedicated thread of the server process (`--engine-loop thread`).

Why a thread: `Engine` is not thread-safe and its rounds are long, blocking calls; running them
on the event loop would stall every connection for a round. The thread owns the engine outright:
commands reach it through a queue, and each round's `RoundBatch` goes back to the event loop in
one `call_soon_threadsafe` call, so the cost of crossing threads is paid per round, not per
token. (`docs/server.md` says why the thread, not the process, is the default.)

Commands are applied between rounds, so an abort frees its slot and KV in the next round.

A thread that dies (an exception escaped the driver) reports it to the event loop at once; a
thread stuck in a round cannot be replaced, as it still owns the engine and its device memory,
so the supervisor ends the server instead (`docs/reliability.md`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from hipfire_serve.server.engine_client import (
    EngineClient,
    EngineUnavailable,
    startup_batch,
    with_served_stats,
)
from hipfire_serve.server.engine_loop import CallCommand, EngineDriver

logger = logging.getLogger("hipfire_serve.server")

# How long `stop` waits for a failed engine's thread: one stuck in a round may never return.
FAILED_JOIN_S = 1.0


class AsyncEngine(EngineClient):
    """Drives one `Engine` from a thread; the methods below are for the event loop only."""

    def __init__(
        self,
        engine: Any,
        *,
        on_round: Callable[[Any], None] | None = None,
        idle_poll_s: float = 1.0,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.on_round = on_round
        self._idle_poll_s = idle_poll_s
        self._driver = EngineDriver(engine)
        self._commands: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- event-loop side ---

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hipfire-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            timeout_s = FAILED_JOIN_S if self.fault is not None else None
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine thread is still inside a round; leaving it behind")
            self._thread = None
        self._end_everything("shutdown", EngineUnavailable("the server is shutting down"))

    def fail(self, message: str) -> None:
        # A thread that comes back from a stuck round must not serve again.
        self._stopping = True
        self._wake.set()
        super().fail(message)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(engine)` in the engine thread between rounds (tests and diagnostics)."""
        return await self._ask(lambda call_id: CallCommand(call_id, fn))

    def _send(self, command: Any) -> None:
        self._commands.append(command)
        self._wake.set()

    # --- engine-thread side ---

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("the engine thread died")
            message = f"the engine thread died: {type(exc).__name__}: {exc}"
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self.report_fault, message)

    def _serve(self) -> None:
        driver = self._driver
        loop = self._loop
        loop.call_soon_threadsafe(self._deliver, startup_batch(self.engine))
        while not self._stopping:
            while self._commands:
                driver.apply(self._commands.popleft())
            batch = with_served_stats(driver.run_round(), self.engine)
            if batch is not None:
                loop.call_soon_threadsafe(self._deliver, batch)
            self._wake.clear()
            if not self._commands and not driver.has_work():
                self._wake.wait(self._idle_poll_s)
