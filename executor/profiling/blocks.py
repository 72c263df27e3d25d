"""A block drafter timed as the engine pays it, on a block drafter outside any executor
(`standalone_block_drafter`): its proposal (one forward of every speculating request's block,
then the logits and picks of the drafts to verify) by speculating requests, drafts and context,
and its context write (the fc and k/v projections and the paged store of every row of a target
forward) by rows."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from executor.drafters.base import DraftRequest
from executor.drafters.block_drafter import BlockDrafter
from executor.drafters.block_model import BlockDraftModel
from executor.profiling.device import sync_device

PAGE = 16  # KV page of the standalone drafter's cache (the engine's default block size)


def standalone_block_drafter(
    model: BlockDraftModel, max_reqs: int, max_context: int, graphs: bool = True
) -> BlockDrafter:
    """A block drafter outside any executor, for timing: its own context cache and a block
    table giving each of `max_reqs` slots pages for `max_context` tokens and a whole block
    past them (graphs lazy on a GPU unless `graphs` is False)."""
    blocks_each = -(-(max_context + model.config.block_size) // PAGE)
    drafter = BlockDrafter(
        model,
        num_blocks=max_reqs * blocks_each + 1,
        block_size=PAGE,
        max_slots=max_reqs,
        max_model_len=blocks_each * PAGE,
        graphs="lazy" if graphs else "off",
    )
    table = np.arange(1, max_reqs * blocks_each + 1, dtype=np.int32).reshape(max_reqs, -1)
    drafter.bind_block_tables(table)
    return drafter


def _timed_ms(
    device: torch.device, fn, args: tuple, repeats: int, warmup: int = 2, inner: int = 1
) -> float:
    """Median wall ms of `fn(*args)` with the device synchronised around it, over `repeats`
    after `warmup` calls; `inner` calls per timing (short device work: the sync's cost spread)."""
    times = []
    for i in range(repeats + warmup):
        sync_device(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(*args)
        sync_device(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def time_block_proposals(
    drafter: BlockDrafter,
    num_specs: tuple[int, ...],
    drafts: tuple[int, ...],
    context_lens: tuple[int, ...],
    repeats: int,
    vocab: int,
) -> list[list[float]]:
    """`BlockDrafter.propose` (greedy) for k requests of c tokens of context drafting d tokens
    each, every (k, c, d): wall ms with a device sync, median of `repeats` after two warm-up
    proposals. A proposal is one forward of k blocks of `block_size` rows whatever d (their
    attention reads the c context positions of each), then the logits of the k * d drafts.
    The context's contents do not matter for the time. -> [[k, c, d, ms], ...]"""
    g = torch.Generator().manual_seed(3)
    out = []
    for c in context_lens:
        contexts = torch.randint(0, vocab, (max(num_specs, default=0), c), generator=g).tolist()
        for k in num_specs:
            for d in drafts:
                requests = [DraftRequest(slot, contexts[slot], d) for slot in range(k)]
                ms = _timed_ms(drafter.device, drafter.propose, (requests, [True] * k), repeats)
                out.append([k, c, d, round(ms, 4)])
    return out


def time_context_write(
    drafter: BlockDrafter, rows: tuple[int, ...], repeats: int
) -> list[list[float]]:
    """`BlockDrafter.extend_context` over n rows of captured target states (random), as every
    target forward of n rows pays it: wall ms per write with a device sync, ten writes per
    timing, median of `repeats`. The rows go to distinct positions of the drafter's cache
    (slots past it are skipped as padding). -> [[n, ms], ...]"""
    model = drafter.model
    width = len(drafter.capture_layer_ids) * model.config.decoder.hidden_size
    capacity = drafter.kv.num_blocks * drafter.kv.block_size
    g = torch.Generator(device=model.device).manual_seed(4)
    out = []
    for n in rows:
        hidden = torch.randn(n, width, generator=g, device=model.device).to(model.dtype)
        positions = torch.arange(n, device=model.device) % model.decoder.max_position
        slots = torch.arange(n, device=model.device) + PAGE  # past the first (unused) page
        slots = torch.where(slots < capacity, slots, -1)
        args = (hidden, positions, slots)
        ms = _timed_ms(model.device, drafter.extend_context, args, repeats, inner=10)
        out.append([n, round(ms, 4)])
    return out
