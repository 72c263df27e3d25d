"""The engine loop in a dedicated thread of the server process (`--engine-loop thread`).

Why a thread: `Engine` is not thread-safe and its rounds are long, blocking calls; running them
on the event loop would stall every connection for a round. The thread owns the engine outright:
commands reach it through a queue, and each round's `RoundBatch` goes back to the event loop in
one `call_soon_threadsafe` call, so the cost of crossing threads is paid per round, not per
token. (`docs/server.md` says why the thread, not the process, is the default.)

Commands are applied between rounds, so an abort frees its slot and KV in the next round.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

from hipfire_serve.server.engine_client import EngineClient
from hipfire_serve.server.engine_loop import CallCommand, EngineDriver


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
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_all("shutdown")

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
        driver = self._driver
        loop = self._loop
        while not self._stopping:
            while self._commands:
                driver.apply(self._commands.popleft())
            batch = driver.run_round()
            if batch is not None:
                loop.call_soon_threadsafe(self._deliver, batch)
            self._wake.clear()
            if not self._commands and not driver.has_work():
                self._wake.wait(self._idle_poll_s)
