"""Drafters timed as the engine pays them: a draft model's chain steps, whole proposals after a
verified round, their growth with context, and catch-ups of whole prompts, each on a draft model
outside any executor (`standalone_drafter`); and a drafter without a model (prompt lookup) on
the host."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DraftModelDrafter
from executor.model import Model
from executor.profiling.device import sync_device

# Catch-ups timed for the profile: whole prompts of CATCHUP_PROMPT_ROWS rows, one prompt up to
# that many rows and up to 16 of them at once past it (a batch entering speculation together);
# 64 rows: a lag of a few dozen AR rounds, which a graphed drafter takes in one wide replay.
CATCHUP_PROMPT_ROWS = 1024
CATCHUP_ROWS = (64, 256, 512, 1024, 2048, 4096, 16384)


def standalone_drafter(
    model: Model, max_reqs: int, max_context: int, depth: int, graphs=True, table_width: int = 0
):
    """A draft-model drafter outside any executor, for timing: its own KV cache and a block
    table giving each of `max_reqs` slots blocks for `max_context` tokens and `depth` drafts
    (graphs lazy on a GPU unless `graphs` is False), the table padded with block 0 to
    `table_width` columns when wider."""
    block = 16
    blocks_each = -(-(max_context + depth + 1) // block)
    drafter = DraftModelDrafter(
        model,
        num_blocks=max_reqs * blocks_each + 1,
        block_size=block,
        max_slots=max_reqs,
        max_model_len=blocks_each * block,
        graphs="lazy" if graphs else "off",
    )
    table = np.arange(1, max_reqs * blocks_each + 1, dtype=np.int32).reshape(max_reqs, -1)
    if table_width > blocks_each:  # entries past a slot's blocks are never read
        table = np.pad(table, ((0, 0), (0, table_width - blocks_each)))
    drafter.bind_block_tables(table)
    return drafter


def draft_bench(
    model: Model,
    max_reqs: int,
    context_len: int,
    depth: int,
    graphs: bool = True,
    table_width: int = 0,
) -> tuple:
    """What the draft-model timings share: a `standalone_drafter` for `max_reqs` requests
    drafting up to `depth` tokens after `context_len`, and their random contexts (one seeded
    generator). -> (drafter, contexts [max_reqs][context_len])"""
    drafter = standalone_drafter(model, max_reqs, context_len, depth, graphs, table_width)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    contexts = torch.randint(0, vocab, (max_reqs, context_len), generator=g).tolist()
    return drafter, contexts


def time_draft_steps(
    model: Model,
    rows: tuple[int, ...],
    repeats: int,
    graphs: bool = True,
    chain: int = 7,
    context_len: int = 16,
    table_width: int = 0,
    bench: tuple | None = None,
) -> list[list[float]]:
    """One chain step of a draft model as the engine pays it: `DraftModelDrafter.propose` for
    `n` requests drafting `chain` tokens each from a caught-up context (host planning, uploads,
    step 0 and the chain steps, graph replays on a GPU unless `graphs` is False, the copy of
    the drafts back), divided by `chain`; median of `repeats` after two warm-up proposals.
    `table_width`: block-table columns (the serving executor's), so the graphs replayed and
    the attention's split plan (both follow the table's width) are the ones serving uses.
    `bench`: a `draft_bench` set-up to time on (made here when None)."""
    drafter, contexts = bench or draft_bench(
        model, max(rows), context_len, chain, graphs, table_width
    )
    out = []
    for n in rows:
        requests = [DraftRequest(slot, contexts[slot], chain) for slot in range(n)]
        greedy = [True] * n
        times = []
        for i in range(repeats + 2):
            sync_device(model.device)
            t0 = time.perf_counter()
            # a proposal leaves the slot caught up on its context (the drafts' KV would only
            # count after a commit), so every timed proposal is step 0 plus the chain
            drafter.propose(requests, greedy)
            sync_device(model.device)
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3 / chain)
        out.append([n, round(statistics.median(times), 4)])
    return out


def time_draft_proposals(
    model: Model,
    num_specs: tuple[int, ...],
    drafts: tuple[int, ...],
    repeats: int,
    graphs: bool = True,
    context_len: int = 16,
    table_width: int = 0,
    bench: tuple | None = None,
) -> list[list[float]]:
    """A draft model's whole proposal as the engine pays it after a verified round:
    `DraftModelDrafter.propose` for `k` requests drafting `d` tokens each, its first step
    catching up 1 row per request (a chain cut short) or 2 (a chain fully accepted: its last
    draft was never fed), every other request each way; wall ms with a device sync, median of
    `repeats` after two warm-up proposals, per (k, d). -> [[k, d, ms], ...]. Every repeat
    starts from that state: the drafter's commit after a round without drafts rewinds its KV
    length (what it does after an AR round), so contexts stay at `context_len`."""
    if not num_specs or not drafts:
        return []
    drafter, contexts = bench or draft_bench(
        model, max(num_specs), context_len, max(drafts), graphs, table_width
    )
    out = []
    for k in num_specs:
        for d in drafts:
            requests = [DraftRequest(slot, contexts[slot], d) for slot in range(k)]
            greedy = [True] * k
            times = []
            for i in range(repeats + 2):
                for slot in range(k):  # KV through all but the last 1 or 2 context tokens
                    drafter.commit(slot, contexts[slot][: len(contexts[slot]) - slot % 2], 0, 0)
                sync_device(model.device)
                t0 = time.perf_counter()
                drafter.propose(requests, greedy)
                sync_device(model.device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            out.append([k, d, round(statistics.median(times), 4)])
    return out


def draft_kv_slope(
    model: Model,
    counts: tuple[int, ...],
    depth: int,
    ref_len: int,
    long_len: int,
    repeats: int,
    table_width: int = 0,
    ref_bench: tuple | None = None,
) -> dict:
    """What a draft model's proposal costs more per draft and per context token: whole
    proposals (`time_draft_proposals`) of `depth` drafts for k requests in `counts` at `ref_len`
    and at `long_len` tokens of context; per k the slope (ms(long) - ms(ref)) / (k * depth *
    (long_len - ref_len)), and their median (never below 0) as `kv_ms_per_token`. Each chain
    step (and step 0) reads the whole draft KV of every drafting request, so a proposal grows
    with the contexts, which proposals timed at the reference context alone do not show.
    -> {"kv_ms_per_token", "points": [[k, ms ref, ms long], ...]}"""
    if long_len <= ref_len or not counts:
        return {"kv_ms_per_token": 0.0, "points": []}
    ref = time_draft_proposals(
        model,
        counts,
        (depth,),
        repeats,
        context_len=ref_len,
        table_width=table_width,
        bench=ref_bench,
    )
    long = time_draft_proposals(
        model, counts, (depth,), repeats, context_len=long_len, table_width=table_width
    )
    points, slopes = [], []
    for (k, _, ms_ref), (_, _, ms_long) in zip(ref, long):
        points.append([k, ms_ref, ms_long])
        slopes.append((ms_long - ms_ref) / (k * depth * (long_len - ref_len)))
    return {
        "kv_ms_per_token": float(f"{max(statistics.median(slopes), 0.0):.4g}"),
        "points": points,
    }


def catchup_profile_rows(max_model_len: int) -> tuple[int, ...]:
    """The catch-up row counts to time for a model of `max_model_len`: those whose prompts
    (at most CATCHUP_PROMPT_ROWS rows each) fit its context with the draft."""
    fits = max_model_len - 2 >= min(CATCHUP_PROMPT_ROWS, 256)
    longest = min(CATCHUP_PROMPT_ROWS, max_model_len - 2)
    return tuple(r for r in CATCHUP_ROWS if fits and min(r, CATCHUP_PROMPT_ROWS) <= longest)


def time_draft_catchup(
    model: Model,
    rows: tuple[int, ...],
    repeats: int,
    graphs: bool = True,
    rows_per_req: int = 0,
) -> list[list[float]]:
    """The draft model catching up `r` context rows from nothing (what the first speculating
    round after prefills pays; longer than the graphed passes, so one eager forward), picking
    one draft per request: `propose` wall time with a device sync, median of `repeats` after a
    warm-up call, per row count. Up to `rows_per_req` rows (0: no limit) are one request's
    prompt; more rows are that many requests' prompts caught up together, as when a whole batch
    enters speculation at once (a 16k-row catch-up costs what its compute costs, far more than
    one prompt's launch-bound forward)."""
    if not rows:
        return []
    per_req = rows_per_req or max(rows)
    shapes = [(-(-n // per_req), min(n, per_req)) for n in rows]  # (requests, rows each)
    max_reqs = max(k for k, _ in shapes)
    drafter = standalone_drafter(model, max_reqs, per_req, 2, graphs)
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, model.config.vocab_size, (per_req,), generator=g).tolist()
    out = []
    for num_reqs, each in shapes:
        requests = [DraftRequest(s, context[:each], 1) for s in range(num_reqs)]
        times = []
        for i in range(repeats + 1):
            for r in requests:  # nothing drafted yet: all rows to catch up
                drafter.setup(r.slot, r.context)
            sync_device(model.device)
            t0 = time.perf_counter()
            drafter.propose(requests, [True] * num_reqs)
            sync_device(model.device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        for r in requests:
            drafter.release(r.slot)
        out.append([num_reqs * each, round(statistics.median(times), 4)])
    return out


def time_host_drafter(
    drafter, rows: tuple[int, ...], repeats: int, context_len: int, vocab: int, depth: int = 8
) -> list[list[float]]:
    """A drafter without a model (prompt lookup) on the host: `propose` for `n` requests of
    `context_len` random tokens drafting `depth - 1` each, wall ms, median of `repeats` after a
    warm-up call, per request count. Its time is the host's, inside every speculating round."""
    g = torch.Generator().manual_seed(2)
    contexts = torch.randint(0, vocab, (max(rows, default=1), context_len), generator=g).tolist()
    out = []
    for n in rows:
        requests = [DraftRequest(slot, contexts[slot], depth - 1) for slot in range(n)]
        for r in requests:
            drafter.setup(r.slot, r.context)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            drafter.propose(requests, [True] * n)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        for r in requests:
            drafter.release(r.slot)
        out.append([n, round(statistics.median(times), 4)])
    return out


def host_drafter_profile(drafter, rows, repeats: int, context_len: int, vocab: int) -> dict:
    """The profile's `drafter_host` section: a model-free drafter's proposal time by requests."""
    return {
        "name": drafter.name,
        "propose_ms": time_host_drafter(drafter, rows, repeats, context_len, vocab),
        "context_len": context_len,
        "note": "one proposal of depth - 1 drafts per request, on the host",
    }
