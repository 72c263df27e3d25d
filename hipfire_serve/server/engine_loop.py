"""The engine side of an engine loop, shared by the thread (`AsyncEngine`) and the child process
(`ProcessEngine`): the commands the event loop sends, and `EngineDriver`, which applies them
between rounds, steps the engine and gathers what one round reports in one `RoundBatch`.

Commands and batches are msgspec Structs so the process loop can send them over its pipe as
they are; the thread loop hands the same objects across threads without encoding them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from hipfire_serve.types import RequestOutput, SamplingParams

logger = logging.getLogger("hipfire_serve.server")

StatsT = TypeVar("StatsT")

# Wait before the step after a failed one: an engine whose bookkeeping broke may still report
# work, and retrying at once would spin on the same failing round.
FAILED_STEP_PAUSE_S = 0.05


def serving_threads(engine: Any) -> int | None:
    """Leaves a core to the event loop: a CPU engine's torch intra-op threads become one fewer
    than the cores this process may run on (at most torch's own choice, at least one), unless
    OMP_NUM_THREADS sets them. The event loop, the clients of a local benchmark and torch's
    pool then never want more cores than there are: an intra-op pool as wide as the machine
    waits at every op's barrier for a worker the loop has displaced (a decode round of the
    demo model on 2 cores took about twice as long served as in-process). Returns the count
    set, None where nothing was changed (a GPU engine, a test double, OMP_NUM_THREADS)."""
    device = getattr(engine, "device", None)
    if getattr(device, "type", None) != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, min(torch.get_num_threads(), (cores or 1) - 1))
    torch.set_num_threads(threads)
    return threads


class AddCommand(msgspec.Struct, tag="add"):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    tenant: str
    arrival_time: float


class AbortCommand(msgspec.Struct, tag="abort"):
    request_id: str


class StatsCommand(msgspec.Struct, tag="stats"):
    """Answered with the stats of the batch that follows (after that batch's round)."""

    call_id: int


@dataclass(frozen=True)
class CallCommand:
    """Runs `fn(engine)` between rounds. Thread loop only: a function cannot cross a pipe."""

    call_id: int
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class CallAnswer:
    call_id: int
    value: Any
    error: Exception | None


class AddReply(msgspec.Struct):
    request_id: str
    taken_at: float = 0.0  # monotonic time the engine took the request in (on success)
    error: str | None = None  # "queue_full" | "context_length" | "value" | "internal"
    message: str = ""
    numbers: list[int] = []  # ContextLengthError: prompt_len, max_tokens, max_model_len


class RoundBatch(msgspec.Struct, Generic[StatsT], tag="round"):
    """What one round reports to the event loop. `StatsT` is the engine's stats type; the
    process loop names it when it decodes (`RoundBatch[EngineStats]`)."""

    replies: list[AddReply]  # one per add applied before this round
    outputs: list[RequestOutput]
    stats: StatsT | None
    stats_calls: list[int]  # StatsCommand call ids answered with `stats`
    stepped: bool = False
    failed: bool = False  # step() itself raised: every request in flight was aborted
    call_answers: list[Any] = []  # CallAnswer of each CallCommand (thread loop only)


def add_error(reply: AddReply) -> Exception | None:
    """The exception `Engine.add_request` raised for `reply`, rebuilt; None on success."""
    if reply.error is None:
        return None
    from hipfire_serve.engine import ContextLengthError, QueueFullError

    if reply.error == "context_length":
        return ContextLengthError(*reply.numbers)
    if reply.error == "queue_full":
        return QueueFullError(reply.message)
    if reply.error == "value":
        return ValueError(reply.message)
    return RuntimeError(reply.message)


class EngineDriver:
    """Owns one engine on its own thread or process: `apply` takes commands between rounds,
    `run_round` steps once if there is work and returns the round's batch (None: nothing to
    report). Keeps the ids of the requests in flight, so a failed step can abort them all.
    Sets a CPU engine's torch threads for serving (`serving_threads`): torch applies the
    count to threads started afterwards too, so the engine thread gets it."""

    def __init__(self, engine: Any) -> None:
        from hipfire_serve.engine import ContextLengthError, QueueFullError

        self.engine = engine
        self.torch_threads = serving_threads(engine)
        if self.torch_threads is not None:
            logger.info(
                "torch intra-op threads: %d (a core left to the event loop)", self.torch_threads
            )
        self._queue_full_error = QueueFullError
        self._context_error = ContextLengthError
        self._live: set[str] = set()  # added, not yet finished or aborted
        self._replies: list[AddReply] = []
        self._stats_calls: list[int] = []
        self._call_answers: list[CallAnswer] = []
        self._last_step_failed = False

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def apply(self, command: Any) -> None:
        if isinstance(command, AddCommand):
            self._replies.append(self._add(command))
        elif isinstance(command, AbortCommand):
            self._live.discard(command.request_id)
            self._abort(command.request_id)
        elif isinstance(command, StatsCommand):
            self._stats_calls.append(command.call_id)
        elif isinstance(command, CallCommand):
            try:
                answer = CallAnswer(command.call_id, command.fn(self.engine), None)
            except Exception as exc:
                answer = CallAnswer(command.call_id, None, exc)
            self._call_answers.append(answer)
        else:
            raise TypeError(f"not an engine command: {command!r}")

    def _add(self, command: AddCommand) -> AddReply:
        reply = AddReply(command.request_id)
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                tenant=command.tenant,
                arrival_time=command.arrival_time,
            )
            self._live.add(command.request_id)
            reply.taken_at = time.monotonic()
        except self._queue_full_error as exc:
            reply.error, reply.message = "queue_full", str(exc)
        except self._context_error as exc:
            reply.error, reply.message = "context_length", str(exc)
            reply.numbers = [exc.prompt_len, exc.max_tokens, exc.max_model_len]
        except ValueError as exc:
            reply.error, reply.message = "value", str(exc)
        except Exception as exc:
            logger.exception("add_request %s failed", command.request_id)
            reply.error, reply.message = "internal", str(exc)
        return reply

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def run_round(self) -> RoundBatch | None:
        outputs: list[RequestOutput] = []
        stepped = failed = False
        if self.engine.has_unfinished():
            if self._last_step_failed:
                time.sleep(FAILED_STEP_PAUSE_S)
            try:
                outputs = self.engine.step()
                stepped = True
            except Exception:
                # The engine fails a round's requests itself; reaching here means its own
                # bookkeeping broke. Abort and fail everything in flight rather than hang
                # clients or retry the same broken round forever.
                logger.exception("engine step failed; aborting in-flight requests")
                for request_id in self._live:
                    self._abort(request_id)
                self._live.clear()
                failed = True
            self._last_step_failed = failed
            for output in outputs:
                if output.finished:
                    self._live.discard(output.request_id)
        asked = bool(self._replies or self._stats_calls or self._call_answers)
        if not (stepped or failed or asked):
            return None
        batch = RoundBatch(
            replies=self._replies,
            outputs=outputs,
            stats=self.engine.stats() if (stepped or asked) else None,
            stats_calls=self._stats_calls,
            stepped=stepped,
            failed=failed,
            call_answers=self._call_answers,
        )
        self._replies, self._stats_calls, self._call_answers = [], [], []
        return batch
