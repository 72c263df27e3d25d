"""A launched round, as `RoundExecutor.launch` hands it to `RoundExecutor.finish`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.accept import AcceptLaunch
from executor.drafters.base import DraftBatch
from executor.ragged_batch import RaggedBatch
from scheduler.plan import RoundPlan


@dataclass(frozen=True)
class LaunchTimes:
    """Host clock (`time.perf_counter`) where each phase of a launch began, and its end."""

    draft: float
    build: float
    forward: float
    accept: float
    launched: float


@dataclass
class PendingRound:
    """A launched round: everything `finish` needs once the device is done. A round without
    rows holds only its plan, `t0` and `start_event`."""

    plan: RoundPlan
    t0: float  # host clock when the launch started
    times: LaunchTimes | None = None
    batch: RaggedBatch | None = None
    drafts: DraftBatch | None = None
    accept: AcceptLaunch | None = None
    greedy_dev: torch.Tensor | None = None  # [L] bool on the device: the row decodes greedily
    bucket: int = 0  # the graph bucket the forward replayed, 0: eager
    # on a GPU: recorded when the launch starts, after its last device work (the acceptance)
    # and around the forward
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    fwd_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    behind: bool = False  # launched while an advanced round was still running
    overlapped: bool = False  # a later round was launched before this one finished
    # advanced (see `RoundExecutor.advance`): [n] the token each row emits, on the device
    tokens_dev: torch.Tensor | None = None
