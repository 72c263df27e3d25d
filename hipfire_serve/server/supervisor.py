"""The engine supervisor: notices a dead or stalled engine, answers everyone waiting on it, and
restarts it or ends the server.

Faults: the engine is gone (the thread died, the child exited: reported by the transport at
once, checked again every tick), or it stalls (something waits on it and no round comes back
for `--engine-stall-timeout`; the time is summed over the supervisor's own ticks, each counted
at most twice its length, so a server frozen as a whole does not blame its engine on resume).

On a fault every waiting and in-flight request fails (503 + Retry-After before its stream
started, an error event after), `/health` turns 503 and the engine gauges go to 0. Then the
process loop gets a fresh child while restarts stay within `--engine-restarts` per 10 minutes;
otherwise (thread loop, too many restarts, a child that fails to start, a fault while draining)
the server exits with status 1 for an outside supervisor to restart. A thread stuck in a round
cannot be replaced in-process: it still owns the engine and its memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from hipfire_serve.round_stats import EngineStats
from hipfire_serve.server.engine_client import EngineClient

logger = logging.getLogger("hipfire_serve.server")

RESTART_WINDOW_S = 600.0
MAX_TICK_S = 0.25  # a stall is noticed at most two ticks past the bound


def idle_stats(last: Any) -> EngineStats:
    """Stats of an engine holding nothing, shaped like the last ones it reported."""
    num_blocks = getattr(last, "num_kv_blocks", 0)
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        slot_capacity=getattr(last, "slot_capacity", 0),
        live_slots=0,
        num_kv_blocks=num_blocks,
        num_free_kv_blocks=num_blocks,
    )


class EngineSupervisor:
    """Watches one `EngineClient` from the event loop (`start` .. `stop`)."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        stall_timeout_s: float,
        max_restarts: int,
        is_draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.max_restarts = max_restarts
        self.is_draining = is_draining
        self.on_fatal: Callable[[str], None] | None = None  # ends the server (status 1)
        self._restarts: collections.deque[float] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stalled_s = 0.0
        self._last_tick = time.monotonic()
        self._seen_progress_at: float | None = None
        self._tick_s = min(MAX_TICK_S, stall_timeout_s / 4) if stall_timeout_s > 0 else MAX_TICK_S

    def start(self) -> None:
        self.engine.on_fault = self._wake.set
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._tick_s)
            self._wake.clear()
            fault = self.check()
            if fault is not None and not await self._recover(fault):
                return  # the server is going down

    def check(self) -> str | None:
        """Why the engine is failed now, or None."""
        engine = self.engine
        if engine.fault is not None:
            return engine.fault
        if not engine.running:
            return "the engine loop stopped"
        stalled_s = self._count_stall()
        if self.stall_timeout_s > 0 and stalled_s > self.stall_timeout_s:
            return (
                f"the engine made no progress for {stalled_s:.1f} s "
                f"(--engine-stall-timeout {self.stall_timeout_s:g}) with "
                f"{engine.num_waiting_on_engine} request(s) waiting on it"
            )
        return None

    def _count_stall(self) -> float:
        """Seconds the engine has gone without progress while requests waited on it."""
        now = time.monotonic()
        elapsed_s = min(now - self._last_tick, 2 * self._tick_s)
        self._last_tick = now
        progress_at = self.engine.progress_at
        if not self.engine.num_waiting_on_engine or progress_at != self._seen_progress_at:
            self._seen_progress_at = progress_at
            self._stalled_s = 0.0
        else:
            self._stalled_s += elapsed_s
        return self._stalled_s

    async def _recover(self, fault: str) -> bool:
        """Fails everything on the engine, then restarts it (True) or ends the server."""
        engine = self.engine
        num_waiting = engine.num_waiting_on_engine
        logger.error("engine failed: %s; failing %d request(s)", fault, num_waiting)
        engine.fail(fault)
        self._stalled_s = 0.0
        self._reset_gauges()
        reason = self._why_not_restart()
        if reason is None:
            began = time.monotonic()
            self._restarts.append(began)
            try:
                await engine.restart()
            except Exception as exc:
                reason = f"the engine did not restart: {exc}"
            else:
                logger.warning("engine restarted in %.1f s", time.monotonic() - began)
                return True
        logger.error("%s: exiting with status 1", reason)
        if self.on_fatal is not None:
            self.on_fatal(fault)
        return False

    def _why_not_restart(self) -> str | None:
        if not self.engine.can_restart:
            return "the engine runs in a thread, which cannot be replaced"
        if self.is_draining():
            return "the server is draining"
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return f"{len(self._restarts)} restart(s) in {RESTART_WINDOW_S:g} s already"
        return None

    def _reset_gauges(self) -> None:
        on_round: Any = self.engine.on_round
        if on_round is None:
            return
        try:
            on_round(idle_stats(self.engine.last_stats))
        except Exception:
            logger.exception("metrics reset failed")
