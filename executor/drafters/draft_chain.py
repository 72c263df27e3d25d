"""The host side of a draft model's chain: its plan, uploaded once so that no step of the chain
waits for the device, and the drafts' one copy back to the host."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from executor.device_clock import DeviceClock
from executor.drafters.base import DraftBatch, DraftRequest


@dataclass(frozen=True)
class ChainPlan:
    """A proposal's whole chain as planned on the host. Entries of step j (j = 0 ..
    max_draft - 1) are the requests that still draft there: E = sum(num_draft) in all."""

    active: np.ndarray  # [n0] indices of the requests that draft
    ctx_lens: np.ndarray  # [n0] their context lengths
    slots: np.ndarray  # [n0] their slots
    steps: list[np.ndarray]  # per step: positions in `active` still drafting
    step_off: np.ndarray  # [max_draft + 1] first entry of each step
    # [5, E] on the device, per entry: request index, row of `tables`, position of the last
    # committed token, first probs row of the request, flat index of its draft (request order)
    entries_i64: torch.Tensor
    temps: torch.Tensor  # [E] on the device, 0 for greedy
    tables: torch.Tensor  # [n0, width] block-table rows on the device

    def entries(self, j: int):
        """Step j's (request, table row, last position, first probs row, temperature) [e]."""
        sl = slice(int(self.step_off[j]), int(self.step_off[j + 1]))
        e = self.entries_i64
        return e[0, sl], e[1, sl], e[2, sl], e[3, sl], self.temps[sl]

    @property
    def flat_index(self) -> torch.Tensor:
        """[E] each draft's flat index into the [num_reqs, max_draft] drafts, request order."""
        return self.entries_i64[4]


def drafts_resolver(
    tokens_dev: torch.Tensor,  # [E] the drafts in request order, on the device
    clock: DeviceClock,  # marked at the start, after step 0 and at the end of the chain
    num_catchup_rows: int,
    max_draft: int,
    num_active: int,
    draft_offsets: np.ndarray,  # [num_reqs + 1]
) -> Callable[[DraftBatch], None]:
    """Starts the drafts' one copy to the host, without waiting; returns what fills a batch's
    tokens and timings once it is done."""
    done = None
    if tokens_dev.is_cuda:  # into pinned memory
        tokens_host = torch.empty(len(tokens_dev), dtype=torch.int64, pin_memory=True)
        tokens_host.copy_(tokens_dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        tokens_host = tokens_dev

    def resolve(batch: DraftBatch) -> None:
        t_wait = time.perf_counter()
        if done is not None:
            done.synchronize()  # the drafts' one device->host copy
        flat = tokens_host.tolist()
        wait_ms = (time.perf_counter() - t_wait) * 1e3
        # Catch-up time: what step 0 cost beyond a plain chain step (the mean of steps 1..).
        # A single draft has no plain step to compare with: then the catch-up rows' share of
        # step 0 stands in.
        catchup_ms = 0.0
        if num_catchup_rows:
            first_ms, chain_ms = clock.intervals_ms()
            if max_draft > 1:
                step_ms = chain_ms / (max_draft - 1)
                catchup_ms = max(first_ms - step_ms, 0.0)
            else:
                catchup_ms = first_ms * num_catchup_rows / (num_catchup_rows + num_active)
        batch.tokens = [flat[a:b] for a, b in itertools.pairwise(draft_offsets.tolist())]
        batch.catchup_ms = catchup_ms
        # wait_ms: host time waiting for the device at the drafts' copy (host-bound drafting
        # waits little, device-bound drafting much; a deferred batch resolved after the
        # round's forward hardly at all)
        batch.extra = {"num_catchup_rows": num_catchup_rows, "wait_ms": wait_ms}

    return resolve


def plan_chain(
    requests: list[DraftRequest],
    num_drafts: np.ndarray,  # [num_reqs]
    temps: np.ndarray,  # [num_reqs] float32, 0 for greedy
    draft_offsets: np.ndarray,  # [num_reqs + 1] first draft of each request
    *,
    block_tables: np.ndarray,  # the executor's [max_slots, max_blocks_per_seq]
    block_size: int,
    max_position: int,  # drafting writes positions below this
    device: torch.device,
) -> ChainPlan:
    """The host plan of the whole chain, uploaded once: no step waits for the device."""
    max_draft = int(num_drafts.max())
    active = np.flatnonzero(num_drafts > 0)  # [n0] request indices, step 0
    ctx_lens = np.array([len(requests[i].context) for i in active], dtype=np.int64)
    slots = np.array([requests[i].slot for i in active], dtype=np.int64)
    too_far = ctx_lens + num_drafts[active] - 1 > max_position
    if too_far.any():
        k = int(np.flatnonzero(too_far)[0])
        r = requests[int(active[k])]
        raise ValueError(
            f"slot {r.slot}: drafting {r.num_draft} tokens after {len(r.context)} would write "
            f"position {len(r.context) + r.num_draft - 2}; the drafter covers {max_position}"
        )
    steps = [np.arange(len(active))]  # per step: positions in `active` still drafting
    steps += [np.flatnonzero(num_drafts[active] > j) for j in range(1, max_draft)]
    step_off = np.concatenate([[0], np.cumsum([len(x) for x in steps])])  # [max_draft + 1]
    local = np.concatenate(steps)  # [E] index into `active` per entry
    width = -(-int((ctx_lens + num_drafts[active]).max()) // block_size)
    # E = sum(num_draft): every draft is one entry of the step that makes it, so the drafts'
    # flat index in request order (request * max_draft + j) fits the same E columns
    draft_owner = np.repeat(np.arange(len(requests)), num_drafts)  # [E] request order
    flat_index = draft_owner * max_draft + np.arange(len(local)) - draft_offsets[draft_owner]
    plan_i64 = np.stack(
        [
            active[local],  # request index
            local,  # row of the uploaded block-table rows
            ctx_lens[local] - 1,  # position of the last committed token
            draft_offsets[active[local]],  # first probs row of the request
            flat_index,  # (request order, not step order) draft_tokens' flat index
        ]
    )  # [5, E]
    up_i64 = torch.from_numpy(plan_i64).to(device, non_blocking=True)
    up_temps = torch.from_numpy(temps[active[local]]).to(device, non_blocking=True)  # [E]
    up_tables = torch.from_numpy(np.ascontiguousarray(block_tables[slots, :width])).to(
        device, non_blocking=True
    )  # [n0, width]
    return ChainPlan(active, ctx_lens, slots, steps, step_off, up_i64, up_temps, up_tables)
