"""`hipfire-serve profile`: measure the round-time cost profile of the loaded models on a device.

The profile is what the scheduler's cost model starts from (format of the shared H200 profile,
extended):

- `target.rows_ms`: measured time of a whole decode round (host batch build, graph replay of the
  target forward, acceptance, commit) at each row bucket with a short context, so attention is a
  small part of it;
- `target.kv_read_TBps_assumed`: the effective KV read rate, fitted from the same rounds at
  several context lengths (slope of round time over KV tokens), so the cost model's KV term
  `kv_tokens * kv_bytes_per_token / rate` is a measurement, not an assumption;
- `target.rows_kv_ms`: the raw grid (rows, kv tokens per sequence, ms) the two were fitted from;
- `target.prefill_rows_ms`: [rows, ms] whole rounds of prefill chunks (the starts of prompts of
  up to 1024 tokens, no decode rows), eager as such rounds run: what rounds with prefill chunks
  are priced by (flat below the fewest rows, 32: the launch-bound floor of an eager round);
- `target.spec_rows_ms`: [k, r, ms] whole rounds of k speculating sequences of r rows each
  (1 + drafts; k over the powers of two up to the slot count and the slot count, r in 2, 4, 8
  within the spec depth) at the reference context, with the same KV-term subtraction and host
  time as `rows_ms`: what verifying groups costs, which AR rounds of as many rows do not show;
- `draft_model.rows_ms_per_step`: one chain step of the draft model as its proposals pay it
  (host planning, uploads, forward, picking, the copy back) per row count, when a draft model
  is loaded;
- `draft_model.propose_ms`: [k, d, ms] a whole proposal of d drafts (1, 3, 7 within the spec
  depth) for k speculating requests right after a verified round (step 0 catching up 1-2 rows
  per request), at the reference context: what the engine's draft phase costs;
- `draft_model.kv_ms_per_token`: what a proposal costs more per draft and per token of its
  request's context beyond `context_len` (the chain steps read every drafting request's draft
  KV): the slope of `propose_ms` between the reference context and a longer one, so that the
  cost model prices proposals at the contexts the batch really has;
- `draft_model.catchup_rows_ms`: [rows, ms] the draft model catching up whole prompts of up to
  1024 rows (several at once past that), what a request's first speculating round pays after a
  prefill the drafter did not follow; with `catchup_rows_per_pass` and `max_catchup_passes`
  (step-0 passes of a few rows per request) and, for a graphed drafter, `catchup_pass_rows` and
  `catchup_pass_buckets` (its wide passes and the row buckets the last one pads to), by which
  the cost model prices catch-ups of any length;
- `target.ar_restart_ms`: [c, ms] what the first AR round after a speculating round costs beyond
  a steady AR round, at c live requests (`time_ar_restart`: the engine relaunches its run-ahead
  pipeline there); the simulator charges it;
- `target.spec_round_ratio`: [k, ratio] full-depth speculating rounds of k requests as the
  engine runs them (`Engine.step`: the executor's round plus the profile's host time around
  it; prompts spread over half to 1.5 times the reference context, as a served batch's) over
  the price the terms above give them; the cost model scales speculating rounds by it (by
  speculating requests);
- `ceilings`: copy bandwidth and bf16 GEMM rate measured on the same device in the same run.

Profiles are cached under `~/.cache/hipfire-serve/profiles/` by a key of the models, device,
dtype and executor configuration.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from executor.drafters.base import DraftBatch
from executor.drafters.draft_model import MAX_CATCHUP_PASSES
from executor.model import Model
from executor.round_executor import RoundExecutor
from scheduler.kv_blocks import BlockPool
from scheduler.plan import Mode, ReqPlan, RoundPlan, SamplingSpec, SeqSetup

CACHE_DIR = Path.home() / ".cache" / "hipfire-serve" / "profiles"
# Part of the cache key: raised when the profile gains a measurement the cost model prices by,
# so that a profile cached before it is measured anew (2: `target.prefill_rows_ms`, 3:
# `draft_model.kv_ms_per_token`, 4: `draft_model.catchup_pass_rows` / `catchup_pass_buckets`,
# 5: a 32-row point in `target.prefill_rows_ms`, 6: `target.ar_restart_ms`).
PROFILE_FORMAT = 6
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
DEFAULT_KV_LENS = (16, 512, 2048)
# Prefill chunks timed for the profile (`target.prefill_rows_ms`), up to the round's prefill
# budget plus a decode row per slot: rounds with a chunk run eagerly, and the graphed decode
# rounds' curve continued linearly priced a 2048-token chunk of an 8B model at 35 ms against
# 51 ms measured (H200, 2026-11-30). 32 rows: the floor of an eager round, bound by launching
# its kernels (a prompt's short last chunk), which the cost model keeps flat below the first point.
PREFILL_ROWS = (32, 256, 1024, 2048, 4096)
PREFILL_CHUNK_ROWS = 1024  # tokens per prompt in those rounds (a typical prompt)


def profile_key(
    target_dir: str,
    draft: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_slots: int,
) -> str:
    h = hashlib.sha256()
    for path in (target_dir, draft):
        p = Path(path)
        cfg = p / "config.json"
        h.update(cfg.read_bytes() if cfg.is_file() else path.encode())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    h.update(f"{name}|{dtype}|{block_size}|{max_slots}|{torch.__version__}".encode())
    h.update(f"|format {PROFILE_FORMAT}".encode())
    return h.hexdigest()[:16]


def cached_profile_path(key: str) -> Path:
    return CACHE_DIR / f"{key}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (read + write) and bf16 GEMM rate of this device, measured now."""
    if device.type != "cuda":
        return {}
    n = 1 << 30  # 1 GiB of bytes per buffer: far past the L2
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    copy_tbps = 2 * n / (statistics.median(times) * 1e-3) / 1e12
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    gemm_tflops = 2 * m**3 / (statistics.median(times) * 1e-3) / 1e12
    return {
        "copy_read_plus_write_TBps": round(copy_tbps, 3),
        "bf16_gemm_TFLOPs": round(gemm_tflops, 1),
    }


class _RepeatDrafter:
    """Proposes the last token again: no host or device cost, so a profiled round is the
    target's cost alone (a real drafter's cost is profiled on its own)."""

    name = "repeat"
    has_probs = False

    def setup(self, slot, context):
        pass

    def release(self, slot):
        pass

    def propose(self, requests, greedy, defer=False):
        return DraftBatch(tokens=[[r.context[-1]] * r.num_draft for r in requests])

    def commit(self, slot, context, num_accepted, num_draft):
        pass


def random_setups(
    ex: RoundExecutor, pool: BlockPool, num_seqs: int, kv_len: int, new_tokens: int, seed
) -> tuple[list[SeqSetup], list]:
    """Set-ups of `num_seqs` requests (req id = slot) with random contexts of `kv_len` tokens
    (a generator seeded with `seed`, or a torch.Generator to draw on), and per slot KV blocks
    for the context and `new_tokens` more, from `pool`. -> (setups, blocks)"""
    vocab = ex.target.config.vocab_size
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    setups, blocks = [], []
    for slot in range(num_seqs):
        context = torch.randint(0, vocab, (kv_len,), generator=g).tolist()
        blocks.append(pool.allocate(slot, -(-(kv_len + new_tokens) // ex.block_size)))
        setups.append(
            SeqSetup(
                req_id=slot,
                slot=slot,
                context_token_ids=tuple(context),
                sampling=SamplingSpec(),
            )
        )
    return setups, blocks


class RoundTimer:
    """Builds synthetic decode rounds (AR rows, or SPEC groups once rows exceed the slots) at a
    given context length and times `RoundExecutor.run` on them."""

    def __init__(self, executor: RoundExecutor, spec_depth: int):
        self.ex = executor
        self.spec_depth = spec_depth
        self.pool = BlockPool(executor.kv.num_blocks, executor.block_size)
        self.last_phases: dict[str, float] = {}  # median phase times (ms) of the last shape

    def _contexts(self, num_seqs: int, kv_len: int, new_tokens: int, seed: int):
        return random_setups(self.ex, self.pool, num_seqs, kv_len, new_tokens, seed)

    def time_round(
        self,
        num_rows: int,
        kv_len: int,
        repeats: int,
        rows_per_seq: int | None = None,
        kv_lens: Sequence[int] | None = None,
    ) -> float:
        """Median wall time (ms) of a round of `num_rows` rows at `kv_len` tokens of context
        per sequence (or `kv_lens`, one length per sequence: a ragged batch); `rows_per_seq`
        > 1 makes speculative groups of that many rows."""
        ex = self.ex
        max_slots = ex.max_slots
        if rows_per_seq is None:
            rows_per_seq = 1 if num_rows <= max_slots else -(-num_rows // max_slots)
        if rows_per_seq > 1 and ex.drafter is None:
            raise ValueError(f"{num_rows} rows need speculative groups: load a drafter")
        num_seqs = -(-num_rows // rows_per_seq)
        lens = [kv_len] * num_seqs if kv_lens is None else [int(n) for n in kv_lens]
        if len(lens) != num_seqs or min(lens) < 1:
            raise ValueError(f"kv_lens: {num_seqs} positive lengths, got {len(lens)}")
        top = max(lens)
        setups, blocks = self._contexts(num_seqs, top, rows_per_seq, num_rows * 7919 + top)
        reqs = []
        remaining = num_rows
        for slot in range(num_seqs):
            n = min(rows_per_seq, remaining)
            remaining -= n
            reqs.append(
                ReqPlan(
                    req_id=slot,
                    slot=slot,
                    mode=Mode.AR if n == 1 else Mode.SPEC,
                    num_computed=lens[slot] - 1,
                    num_new=n,
                    num_draft=n - 1,
                    new_block_ids=blocks[slot],
                )
            )
        plan = RoundPlan.from_reqs(
            reqs,
            round_id=0,
            num_rows=num_rows,
            row_bucket=num_rows,
            spec_depth=rows_per_seq,
        )
        # The target's cost is measured with a cost-free drafter in place: a model drafter's
        # own cost is profiled separately (time_draft_steps).
        drafter = _RepeatDrafter() if rows_per_seq > 1 else None
        states = [(slot, lens[slot], lens[slot] - 1) for slot in range(num_seqs)]
        times, phases = self._time_plan(plan, setups, states, drafter, repeats)
        self.last_phases = {
            name: statistics.median(getattr(p, f"{name}_ms") for p in phases)
            for name in ("build", "draft", "forward", "accept", "commit")
        }
        return statistics.median(times)

    def time_prefill_round(self, num_rows: int, repeats: int, chunk_rows: int) -> float:
        """Median wall time (ms) of a round of prefill chunks only, `num_rows` tokens in chunks
        of at most `chunk_rows` (the starts of as many prompts; eager: rounds with prefill
        chunks replay no graph)."""
        sizes = [min(chunk_rows, num_rows - a) for a in range(0, num_rows, chunk_rows)]
        setups, blocks = self._contexts(len(sizes), max(sizes), 1, num_rows * 7919 + 3)
        chunks = [
            ReqPlan(
                req_id=slot,
                slot=slot,
                mode=Mode.PREFILL,
                num_computed=0,
                num_new=n,
                new_block_ids=blocks[slot],
            )
            for slot, n in enumerate(sizes)
        ]
        plan = RoundPlan.from_reqs(chunks, round_id=0, num_rows=num_rows, row_bucket=num_rows)
        # the prompt's first n tokens, none computed; no drafter: the target's cost alone
        states = [(slot, n, 0) for slot, n in enumerate(sizes)]
        times, _ = self._time_plan(plan, setups, states, None, repeats)
        return statistics.median(times)

    def _time_plan(self, plan, setups, states, drafter, repeats: int) -> tuple[list, list]:
        """`RoundExecutor.run(plan)` timed `repeats` times after two warm-ups, with `drafter`
        in the executor's place: the slots of `setups` are set up first and released (their
        blocks freed) after, and every run starts from the committed state `states`
        [(slot, context length, computed tokens)] (the KV contents do not matter for timing).
        -> (wall ms per run, its PhaseTimes)"""
        ex = self.ex
        saved_drafter, ex.drafter = ex.drafter, drafter
        ex._apply_setup_release(RoundPlan(round_id=0, setup=tuple(setups)))
        slots = tuple(slot for slot, _, _ in states)
        times, phases = [], []
        try:
            for i in range(repeats + 2):
                for slot, context_len, computed in states:
                    ex.rewind(slot, context_len, num_computed=computed)
                _sync(ex.device)
                t0 = time.perf_counter()
                result = ex.run(plan)
                _sync(ex.device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
                    phases.append(result.timings)
        finally:
            ex._apply_setup_release(RoundPlan(round_id=0, release=slots))
            ex.drafter = saved_drafter
            for slot in slots:
                self.pool.free(slot)
        return times, phases


def time_prefill_rows(engine, timer: RoundTimer, repeats: int) -> list[list[float]]:
    """[[rows, ms], ...] rounds of prefill chunks (`RoundTimer.time_prefill_round`, prompts of
    at most PREFILL_CHUNK_ROWS tokens) at the PREFILL_ROWS up to the engine's prefill budget
    plus a row per slot (and the budget itself), those the KV blocks and slots hold."""
    ex = timer.ex
    budget = engine.config.max_prefill_tokens
    top = budget + ex.max_slots
    chunk = min(PREFILL_CHUNK_ROWS, engine.max_model_len - 1)
    out = []
    for n in sorted({r for r in PREFILL_ROWS if r < top} | {budget}):
        seqs = -(-n // chunk)
        if seqs > ex.max_slots or seqs * -(-(chunk + 1) // ex.block_size) > ex.kv.num_blocks:
            continue
        out.append([n, round(timer.time_prefill_round(n, repeats, chunk), 4)])
    return out


def time_rounds_ahead(timer: RoundTimer, num_rows: int, kv_len: int, repeats: int) -> float:
    """Median period (ms) of back-to-back AR rounds of `num_rows` requests at about `kv_len`
    tokens of context, each launched before the previous one finishes (`RoundExecutor.advance`,
    as the engine runs them): what an AR round costs when the host's work between rounds runs
    behind the device's."""
    ex = timer.ex
    if num_rows > ex.max_slots:
        raise ValueError(f"{num_rows} AR rows need as many slots; the executor has {ex.max_slots}")
    num_rounds = repeats + 3
    setups, blocks = timer._contexts(num_rows, kv_len, num_rounds, num_rows * 7919 + kv_len + 1)
    plans = [
        RoundPlan.from_reqs(
            [
                ReqPlan(
                    req_id=slot,
                    slot=slot,
                    mode=Mode.AR,
                    num_computed=kv_len - 1 + i,
                    num_new=1,
                    # every block in the first round's table; later rounds add none
                    block_offset=0 if i == 0 else len(blocks[slot]),
                    new_block_ids=blocks[slot] if i == 0 else (),
                )
                for slot in range(num_rows)
            ],
            round_id=i,
            num_rows=num_rows,
            row_bucket=num_rows,
            spec_depth=1,
        )
        for i in range(num_rounds)
    ]
    saved_drafter, ex.drafter = ex.drafter, None
    ex._apply_setup_release(RoundPlan(round_id=0, setup=tuple(setups)))
    for slot in range(num_rows):
        ex.rewind(slot, kv_len)  # the context taken as computed (its KV contents do not matter)
    ends = []
    try:
        pending = None
        for plan in plans:
            launched = ex.launch(plan)
            if pending is not None:
                ex.finish(pending)
                ends.append(time.perf_counter())
            ex.advance(launched)
            pending = launched
        ex.finish(pending)
        ends.append(time.perf_counter())
    finally:
        ex._apply_setup_release(RoundPlan(round_id=0, release=tuple(range(num_rows))))
        ex.drafter = saved_drafter
        for slot in range(num_rows):
            timer.pool.free(slot)
    periods = np.diff(ends[2:]) * 1e3  # after two rounds of warm-up
    return float(np.median(periods))


def standalone_drafter(
    model: Model, max_reqs: int, max_context: int, depth: int, graphs=True, table_width: int = 0
):
    """A draft-model drafter outside any executor, for timing: its own KV cache and a block
    table giving each of `max_reqs` slots blocks for `max_context` tokens and `depth` drafts
    (graphs lazy on a GPU unless `graphs` is False), the table padded with block 0 to
    `table_width` columns when wider."""
    from executor.drafters.draft_model import DraftModelDrafter

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
    from executor.drafters.base import DraftRequest

    drafter, contexts = bench or draft_bench(
        model, max(rows), context_len, chain, graphs, table_width
    )
    out = []
    for n in rows:
        requests = [DraftRequest(slot, contexts[slot], chain) for slot in range(n)]
        greedy = [True] * n
        times = []
        for i in range(repeats + 2):
            _sync(model.device)
            t0 = time.perf_counter()
            # a proposal leaves the slot caught up on its context (the drafts' KV would only
            # count after a commit), so every timed proposal is step 0 plus the chain
            drafter.propose(requests, greedy)
            _sync(model.device)
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
    from executor.drafters.base import DraftRequest

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
                _sync(model.device)
                t0 = time.perf_counter()
                drafter.propose(requests, greedy)
                _sync(model.device)
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
    with the contexts; profiled at the reference context only, a batch at 8k tokens of context
    was priced as one at 1k. -> {"kv_ms_per_token", "points": [[k, ms ref, ms long], ...]}"""
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


def time_host_drafter(
    drafter, rows: tuple[int, ...], repeats: int, context_len: int, vocab: int, depth: int = 8
) -> list[list[float]]:
    """A drafter without a model (prompt lookup) on the host: `propose` for `n` requests of
    `context_len` random tokens drafting `depth - 1` each, wall ms, median of `repeats` after a
    warm-up call, per request count. Its time is the host's, inside every speculating round."""
    from executor.drafters.base import DraftRequest

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
    from executor.drafters.base import DraftRequest

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
            _sync(model.device)
            t0 = time.perf_counter()
            drafter.propose(requests, [True] * num_reqs)
            _sync(model.device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        for r in requests:
            drafter.release(r.slot)
        out.append([num_reqs * each, round(statistics.median(times), 4)])
    return out


def host_drafter_profile(drafter, rows, repeats: int, context_len: int, vocab: int) -> dict:
    """The profile's `drafter_host` section: a model-free drafter's proposal time by requests."""
    return {
        "name": drafter.name,
        "propose_ms": time_host_drafter(drafter, rows, repeats, context_len, vocab),
        "context_len": context_len,
        "note": "one proposal of depth - 1 drafts per request, on the host",
    }


def _engine_steps(
    engine, c: int, prompt_len: int, num_steps: int, spec_mode: str, ragged: bool = False
) -> tuple[int, list]:
    """Up to `num_steps` decode steps of c greedy requests of `prompt_len` random tokens under
    a throw-away scheduler of `spec_mode` ("ar", "spec": every request drafts its full depth),
    after their prefill and 3 settling steps; then aborts them and drains. `ragged`: prompt
    lengths spread evenly over [prompt_len / 2, 3 prompt_len / 2] instead (mean prompt_len), as
    a served batch's are. -> (c as the KV cache and queue allow it, [(wall ms of
    `Engine.step`, the round's `RoundStats`)]), no steps when the model's context or the KV
    cache cannot keep requests decoding that long. The engine's own scheduler, if it has one
    yet, is put back afterwards."""
    saved = getattr(engine, "scheduler", None)  # (none while the engine is being built)
    try:
        engine.scheduler = engine._make_scheduler(spec_mode, None)
        return _run_steps(engine, c, prompt_len, num_steps, spec_mode, ragged)
    finally:
        if saved is not None:
            engine.scheduler = saved


def prompt_lens(c: int, prompt_len: int, ragged: bool) -> list[int]:
    """c prompt lengths of mean ~prompt_len: all equal, or (`ragged`) spread evenly over
    [prompt_len / 2, 3 prompt_len / 2]."""
    if not ragged or c < 2:
        return [prompt_len] * c
    lo = max(prompt_len // 2, 1)
    return [lo + round(i * (prompt_len * 3 // 2 - lo) / (c - 1)) for i in range(c)]


def _run_steps(
    engine,
    c: int,
    prompt_len: int,
    num_steps: int,
    spec_mode: str,
    ragged: bool = False,
    every_step: bool = False,
):
    """_engine_steps on the throw-away scheduler already in place. `every_step`: the steps that
    finish no round are kept too (with None for the round), and the device is not synchronised
    before a step, so rounds run ahead as in serving."""
    from hipfire_serve.types import SamplingParams

    longest = max(prompt_lens(2, prompt_len, ragged))
    # tokens a request may emit: every measured step can emit a whole draft chain
    max_tokens = (num_steps + 16) * (engine.config.spec_depth if spec_mode == "spec" else 1)
    max_tokens = min(max_tokens, engine.max_model_len - longest)
    if max_tokens < num_steps + 4:
        return c, []  # a context too short to keep requests decoding that long
    # as many requests as can wait and decode together in this engine's KV cache
    blocks_each = -(-(longest + max_tokens) // engine.config.block_size) + 1
    c = min(c, engine.scheduler.config.max_queue, engine.num_kv_blocks // blocks_each)
    if c < 1:
        return c, []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.target.config.vocab_size
    g = torch.Generator().manual_seed(c)
    ids = [f"profile-{spec_mode}-{c}-{i}" for i in range(c)]
    for req_id, n in zip(ids, prompt_lens(c, prompt_len, ragged)):
        prompt = torch.randint(1, vocab, (n,), generator=g).tolist()
        engine.add_request(req_id, prompt, params)
    steps = []
    try:
        while engine.scheduler.stats.num_prefilling or engine.scheduler.num_waiting:
            engine.step()
        for _ in range(3):  # settle: the first decode rounds may still capture graphs
            engine.step()
        engine.stats()  # (round records so far dropped: each step's record is its own)
        for _ in range(num_steps):
            if not engine.has_unfinished():
                break  # (speculating requests can run out of tokens first)
            if not every_step:
                _sync(engine.device)
            t0 = time.perf_counter()
            engine.step()
            wall_ms = (time.perf_counter() - t0) * 1e3
            rounds = engine.stats().rounds
            if rounds or every_step:
                steps.append((wall_ms, rounds[-1] if rounds else None))
    finally:
        for req_id in ids:
            engine.abort(req_id)
        while engine.has_unfinished():
            engine.step()
    return c, steps


def time_engine_overhead(
    engine,
    concurrencies: tuple[int, ...],
    prompt_len: int = 64,
    num_steps: int = 12,
    spec_mode: str = "ar",
) -> list[list[float]]:
    """Per decode round, the engine's host time outside `RoundExecutor` (planning, the
    scheduler's update, output collection, bookkeeping) at each live request count: the wall
    time of `Engine.step` minus the executor's own round time, median of `num_steps`, in plain
    AR decode rounds (`spec_mode` "ar": run ahead, so mostly hidden) or speculating ones
    ("spec": every request drafts; nothing hides), each on a throw-away scheduler."""
    out = []
    for c in concurrencies:
        c, steps = _engine_steps(engine, c, prompt_len, num_steps, spec_mode)
        overheads = [max(wall_ms - stats.measured_s * 1e3, 0.0) for wall_ms, stats in steps]
        if overheads and not any(p[0] == c for p in out):
            out.append([c, round(statistics.median(overheads), 4)])
    return out


class SwitchingPolicy:
    """Every request drafts its full depth for `spec_rounds` rounds, then `ar_rounds` rounds
    decode plainly, over and over (time_ar_restart's rounds)."""

    name = "switching"

    def __init__(self, spec_rounds: int, ar_rounds: int):
        from scheduler.policy import AllARPolicy, AllSpecPolicy

        self.period = spec_rounds + ar_rounds
        self.spec_rounds = spec_rounds
        self.num_decided = 0
        self._spec, self._ar = AllSpecPolicy(), AllARPolicy()

    def decide(self, view, estimator, cost_model):
        spec = self.num_decided % self.period < self.spec_rounds
        self.num_decided += 1
        return (self._spec if spec else self._ar).decide(view, estimator, cost_model)


def time_ar_restart(
    engine,
    concurrencies: tuple[int, ...],
    prompt_len: int = 64,
    num_cycles: int = 8,
    spec_rounds: int = 2,
    ar_rounds: int = 5,
) -> list[list[float]]:
    """What the switch from speculating back to AR costs, per live request count: the wall time
    of the first AR round after a speculating one over a steady AR round's, medians over
    `num_cycles` switches. AR rounds run ahead, one behind the other; the first after a
    speculating round starts from an idle pipeline, and the step that launches it finishes no
    round, so its wall time is counted with that round. Read the same way from the step records
    of the H200 benchmark record of 2026-11-30 17:36 UTC (not by this function, which came
    after it), it was 2.1-3.1 ms at 1 to 128 requests of an 8B model, against a steady AR step of
    4.6-10.6 ms. Needs a drafter and rounds run ahead; -> [[c, ms], ...]"""
    if engine.drafter is None or not engine.config.overlap_rounds:
        return []
    out = []
    for c in concurrencies:
        saved = engine.scheduler
        try:
            engine.scheduler = engine._make_scheduler("spec", None)
            engine.scheduler.policy = SwitchingPolicy(spec_rounds, ar_rounds)
            num_steps = num_cycles * (spec_rounds + ar_rounds)
            _, steps = _run_steps(engine, c, prompt_len, num_steps, "spec", every_step=True)
        finally:
            engine.scheduler = saved
        first, steady = [], []
        carried, prev = 0.0, ""
        for wall_ms, stats in steps:
            if stats is None:  # a step that launched a round ahead and finished none
                carried += wall_ms
                continue
            route = stats.route
            if "S" not in route and "P" not in route:  # an AR round
                if "S" in prev:
                    first.append(wall_ms + carried)
                elif not carried:
                    steady.append(wall_ms)
            carried, prev = 0.0, route
        if first and steady:
            restart = max(statistics.median(first) - statistics.median(steady), 0.0)
            out.append([c, round(restart, 4)])
    return out


def time_spec_round_ratio(
    engine,
    profile: dict,
    concurrencies: tuple[int, ...],
    context_len: int,
    num_steps: int = 24,
    ragged: bool = True,
) -> list[list[float]]:
    """Speculating rounds as the engine pays them against the profile's price of the same
    shapes: per speculating request count, the median over `num_steps` full-depth speculating
    rounds (every request drafting, prompts of `context_len` tokens on average, spread over
    half to 1.5 times it unless not `ragged`) of (the executor's measured round + the profile's
    host time around it) / the profile's price of the round. The profile's speculating terms
    are measured piece by piece (rounds alone, proposals alone, equal contexts); this is the
    factor that puts them together as the engine runs them, on contexts as uneven as a served
    batch's (the cost model prices a batch by its total context; uneven contexts cost more,
    `loadtests.context_probe`). The price leaves out a factor `profile` already holds: the
    factor is against the terms alone. -> [[k, ratio], ...]"""
    from scheduler.cost_model import ProfileCost

    terms = {k: v for k, v in profile["target"].items() if k != "spec_round_ratio"}
    cost = ProfileCost({**profile, "target": terms})
    out = []
    for c in concurrencies:
        ratios = []
        c, steps = _engine_steps(engine, c, context_len, num_steps, "spec", ragged)
        for _, stats in steps:
            drafted = stats.drafted_per_pos
            depth = sum(1 for n in drafted if n > 0)
            k = stats.num_spec
            if not (k and depth) or stats.num_prefill:
                continue
            price = cost.round_ms_scalar(
                stats.num_rows, stats.num_kv_tokens, depth, k, num_draft_rows=int(sum(drafted))
            )
            host = cost.round_spec_host_ms(stats.num_rows, 0, k, depth, int(sum(drafted)))
            if price > 0:
                ratios.append((stats.measured_s * 1e3 + host) / price)
        if ratios and not any(p[0] == c for p in out):
            out.append([c, round(statistics.median(ratios), 4)])
    return out


def drafter_spec_terms(engine, profile: dict, drafter, even: bool = False) -> dict:
    """The profile's speculating terms that depend on the drafter, measured with `drafter` in
    the engine in place of its own (put back afterwards): `spec_host_ms_per_round` (the host
    time around its rounds) and then `spec_round_ratio` against `profile` priced with that host
    time (so `profile` should carry the drafter's own cost terms, e.g. `drafter_host`). A
    profile measured with a draft model prices a prompt-lookup drafter's rounds by these:
    verify rounds without a chain before them pay their host time and overlap differently. The
    engine is idle before and after. `even`: also the ratio on prompts of equal length
    ("spec_round_ratio_even"), what uneven contexts add shows against it.
    -> {"spec_host_ms_per_round": [...], "spec_round_ratio": [...]}"""
    ex = engine.executor
    saved = engine.drafter, ex.drafter, ex.drafter_follows_prefill
    engine.drafter = ex.drafter = drafter
    ex.drafter_follows_prefill = False
    try:
        points = _host_points(ex.max_slots)
        host = time_engine_overhead(engine, points, spec_mode="spec")
        # (time_spec_round_ratio prices without a factor `profile` may hold)
        priced = {**profile, "target": {**profile["target"], "spec_host_ms_per_round": host}}
        ref = profile["target"].get("ref_kv_len") or 1024
        out = {"spec_host_ms_per_round": host}
        out["spec_round_ratio"] = time_spec_round_ratio(engine, priced, points, ref)
        if even:
            out["spec_round_ratio_even"] = time_spec_round_ratio(
                engine, priced, points, ref, ragged=False
            )
    finally:
        engine.drafter, ex.drafter, ex.drafter_follows_prefill = saved
    return out


def _interp(points: list[list[float]], x: float) -> float:
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return float(np.interp(x, xs, ys)) if points else 0.0


# Catch-ups timed for the profile: whole prompts of CATCHUP_PROMPT_ROWS rows, one prompt up to
# that many rows and up to 16 of them at once past it (a batch entering speculation together);
# 64 rows: a lag of a few dozen AR rounds, which a graphed drafter takes in one wide replay.
CATCHUP_PROMPT_ROWS = 1024
CATCHUP_ROWS = (64, 256, 512, 1024, 2048, 4096, 16384)


def catchup_profile_rows(max_model_len: int) -> tuple[int, ...]:
    """The catch-up row counts to time for a model of `max_model_len`: those whose prompts
    (at most CATCHUP_PROMPT_ROWS rows each) fit its context with the draft."""
    fits = max_model_len - 2 >= min(CATCHUP_PROMPT_ROWS, 256)
    longest = min(CATCHUP_PROMPT_ROWS, max_model_len - 2)
    return tuple(r for r in CATCHUP_ROWS if fits and min(r, CATCHUP_PROMPT_ROWS) <= longest)


SPEC_REPEATS = 5  # repeats of the speculating shapes: ~50 of them in a profile built every run


def _spec_counts(max_slots: int) -> tuple[int, ...]:
    """Speculating request counts profiled: the powers of two below the slot count, and it."""
    powers = {1 << i for i in range(max_slots.bit_length())}
    return tuple(sorted({n for n in powers if n < max_slots} | {max_slots}))


def _spec_rows_per_seq(spec_depth: int) -> tuple[int, ...]:
    """Rows per speculating sequence profiled (1 + drafts): 2, 4 and 8 within the spec depth."""
    return tuple(sorted({min(r, spec_depth) for r in (2, 4, 8)} - {1}))


def _host_points(max_slots: int) -> tuple[int, ...]:
    """Live request counts at which the engine's host time per round is measured."""
    return tuple(sorted({c for c in (1, 8, 32, max_slots) if c <= max_slots}))


# Contexts of the draft KV slope (`draft_kv_slope`): the reference and up to DRAFT_KV_SPAN times
# it, where the model's context allows at least DRAFT_KV_MIN_SPAN times it (a shorter span
# leaves the slope to noise); speculating request counts between these bounds (the largest two).
DRAFT_KV_SPAN = 2.0
DRAFT_KV_MIN_SPAN = 1.25
DRAFT_KV_COUNTS = (4, 32)


def _draft_kv_fields(model, spec_counts, spec_depth, ref, engine, repeats, ex, bench) -> dict:
    """The profile's `draft_model.kv_ms_per_token` and its points (absent: no longer context
    fits the model, or the draft depth is 1)."""
    long_len = min(int(ref * DRAFT_KV_SPAN), engine.max_model_len - spec_depth - 2)
    lo, hi = DRAFT_KV_COUNTS
    counts = tuple(k for k in spec_counts if lo <= k <= hi)[-2:]
    depth = spec_depth - 1
    if long_len < ref * DRAFT_KV_MIN_SPAN or not counts or depth < 1:
        return {}
    fit = draft_kv_slope(model, counts, depth, ref, long_len, repeats, ex.max_blocks_per_seq, bench)
    return {
        "kv_ms_per_token": fit["kv_ms_per_token"],
        "kv_points": fit["points"],
        "kv_long_context_len": long_len,
    }


def build_profile(
    engine,
    rows=DEFAULT_ROWS,
    kv_lens=DEFAULT_KV_LENS,
    repeats: int = 10,
    with_ceilings: bool = True,
    ref_kv_len: int | None = None,
    host_overhead: bool = True,
) -> dict:
    """Measures the profile of an `Engine`'s target (and draft model, if any).

    The cost model prices a round as `rows_ms(rows) + kv_tokens * kv_ms_per_token`. Attention
    at small batch is latency-bound, so one fitted KV rate cannot hold from 16 tokens to long
    contexts; `rows_ms` is therefore anchored at `ref_kv_len` tokens of context per sequence
    (default: the profiled context nearest 1024, a typical prompt): rows_ms(n) = measured(n,
    ref) - seqs(n) * ref * kv_ms_per_token, exact at the reference and priced at the fitted
    rate around it. With `host_overhead`, each point also carries the engine's host time per
    round outside the executor (`time_engine_overhead`), so that predicted rounds are the
    engine's real round period."""
    ex: RoundExecutor = engine.executor
    target = engine.target
    cfg = target.config
    timer = RoundTimer(ex, engine.config.spec_depth)
    max_rows = ex.max_slots * engine.config.spec_depth
    rows = tuple(r for r in rows if r <= max_rows and (r <= ex.max_slots or ex.drafter))
    # contexts the model can hold together with a round's rows
    kv_lens = tuple(k for k in kv_lens if k + engine.config.spec_depth <= engine.max_model_len)
    if not kv_lens:
        raise ValueError(f"no profiled context fits --max-model-len {engine.max_model_len}")
    grid = []
    for kv_len in kv_lens:
        for n in rows:
            need = -(-(kv_len + engine.config.spec_depth) // ex.block_size) * min(n, ex.max_slots)
            if need > ex.kv.num_blocks:
                continue
            grid.append([n, kv_len, round(timer.time_round(n, kv_len, repeats), 4)])
    elt = target.weights.embed.element_size()
    kv_bytes = cfg.kv_bytes_per_token(elt)
    prefill_rows_ms = time_prefill_rows(engine, timer, max(2, min(repeats, 5)))

    def num_seqs(n: int) -> int:  # RoundTimer's layout: AR rows up to the slots, then groups
        return -(-n // (1 if n <= ex.max_slots else -(-n // ex.max_slots)))

    # Effective KV read rate: per row count, slope of time over total KV tokens; median.
    rates = []
    for n in rows:
        pts = sorted((kv_len * num_seqs(n), ms) for m, kv_len, ms in grid if m == n)
        if len(pts) >= 2 and pts[-1][1] > pts[0][1]:
            dt_ms = pts[-1][1] - pts[0][1]
            rates.append((pts[-1][0] - pts[0][0]) * kv_bytes / (dt_ms * 1e-3) / 1e12)
    # When round time does not grow with context (tiny models, noise), the KV term is
    # negligible: a very high rate says so, and `kv_rate_fitted` records it.
    kv_rate = statistics.median(rates) if rates else 1e3
    kv_ms_per_token = kv_bytes / (float(f"{kv_rate:.4g}") * 1e12) * 1e3
    measured = {kv_len for _, kv_len, _ in grid}
    ref = min(measured, key=lambda k: abs(k - (ref_kv_len or 1024)))
    host_ms = time_engine_overhead(engine, _host_points(ex.max_slots)) if host_overhead else []
    spec_host_ms = []
    ar_restart = []
    if host_overhead and engine.drafter is not None:
        spec_host_ms = time_engine_overhead(engine, _host_points(ex.max_slots), spec_mode="spec")
        ar_restart = time_ar_restart(engine, _host_points(ex.max_slots))
    # AR rounds run ahead (the engine's default): the host's build and commit hide behind the
    # device, so such a round costs its period, a fraction of the round alone measured above
    ahead_ratio = []
    if engine.config.overlap_rounds:
        alone = {n: ms for n, kv_len, ms in grid if kv_len == ref}
        for n in rows:
            if n <= ex.max_slots and n in alone:
                period = time_rounds_ahead(timer, n, ref, repeats)
                ahead_ratio.append([n, round(min(period / alone[n], 1.0), 4)])
    # (a noisy fit could price the reference context above the round itself: keep a floor)
    rows_ms = [
        [
            n,
            round(
                max(ms - num_seqs(n) * ref * kv_ms_per_token, 0.1 * ms)
                + _interp(host_ms, num_seqs(n)),
                4,
            ),
        ]
        for n, kv_len, ms in grid
        if kv_len == ref
    ]
    # speculating rounds as served: k sequences of r rows each, at the reference context, the
    # same KV-term subtraction and host time as rows_ms (by sequences)
    spec_depth = engine.config.spec_depth
    spec_counts = _spec_counts(ex.max_slots)
    spec_repeats = max(1, min(SPEC_REPEATS, repeats))
    spec_rows_ms = []
    if ex.drafter is not None:
        for k in spec_counts:
            if -(-(ref + spec_depth) // ex.block_size) * k > ex.kv.num_blocks:
                continue
            for r in _spec_rows_per_seq(spec_depth):
                ms = timer.time_round(k * r, ref, spec_repeats, rows_per_seq=r)
                ms = max(ms - k * ref * kv_ms_per_token, 0.1 * ms) + _interp(host_ms, k)
                spec_rows_ms.append([k, r, round(ms, 4)])
    device = target.device
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = {
        "name": f"{engine.model_name}-{dev_name.replace(' ', '-').lower()}",
        "device": f"{dev_name}, torch {torch.__version__}, measured {time.strftime('%Y-%m-%d')}",
        "method": (
            "whole decode rounds through RoundExecutor.run (host build, target forward with "
            "graph replay where enabled, acceptance, commit), median of repeats after warm-up; "
            f"KV rate fitted over contexts {list(kv_lens)}; rows_ms = the round at {ref} "
            "tokens of context per sequence minus that context's KV term"
            + (", plus the engine's host time per round (host_ms_per_round)" if host_ms else "")
            + (
                "; speculating rounds add the engine's host time around them "
                "(spec_host_ms_per_round, by decoding requests)"
                if spec_host_ms
                else ""
            )
            + (
                f"; spec_rows_ms: rounds of k speculating sequences of r rows at {ref} tokens "
                "of context, the same subtraction, median of "
                f"{spec_repeats}"
                if spec_rows_ms
                else ""
            )
        ),
        "ceilings": measure_ceilings(device) if with_ceilings else {},
        "target": {
            "shape": (
                f"{cfg.arch}: hidden {cfg.hidden_size}, intermediate "
                f"{cfg.intermediate_size}, {cfg.num_layers} layers, {cfg.num_q_heads} q "
                f"heads, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}, vocab "
                f"{cfg.vocab_size}"
            ),
            "weight_bytes": target.num_params * elt,
            "rows_ms": rows_ms,
            "kv_bytes_per_token": kv_bytes,
            "kv_read_TBps_assumed": float(f"{kv_rate:.4g}"),
            "kv_rate_fitted": bool(rates),
            "rows_kv_ms": grid,
            "prefill_rows_ms": prefill_rows_ms,
            "spec_rows_ms": spec_rows_ms,
            "ref_kv_len": ref,
            "host_ms_per_round": host_ms,
            "spec_host_ms_per_round": spec_host_ms,
            "ar_ahead_ratio": ahead_ratio,
            "ar_restart_ms": ar_restart,
        },
    }
    draft_model = getattr(engine.drafter, "model", None)
    # (a synthetic drafter runs its inner drafter for the cost)
    inner = getattr(engine.drafter, "inner", engine.drafter)
    passes = getattr(inner, "catchup_rows_per_pass", 0)
    if inner is not None and draft_model is None and hasattr(inner, "propose"):
        # a drafter without a model costs host time in every speculating round
        profile["drafter_host"] = host_drafter_profile(
            copy.deepcopy(inner),  # its configuration, not its slots
            tuple(r for r in rows if r <= ex.max_slots),
            repeats,
            ref,
            cfg.vocab_size,
        )
    if draft_model is not None:
        draft_rows = tuple(r for r in rows if r <= ex.max_slots)
        drafts = tuple(sorted({r - 1 for r in _spec_rows_per_seq(spec_depth)}))
        # one drafter for both timings (its slots caught up by the first)
        bench = draft_bench(
            draft_model,
            max(draft_rows + spec_counts),
            ref,
            max((7, *drafts)),
            table_width=ex.max_blocks_per_seq,
        )
        profile["draft_model"] = {
            "shape": f"{draft_model.config.arch}: hidden {draft_model.config.hidden_size}, "
            f"{draft_model.config.num_layers} layers",
            # at the target's reference context: a step reads every drafting request's KV
            "rows_ms_per_step": time_draft_steps(
                draft_model, draft_rows, repeats, context_len=ref, bench=bench
            ),
            "context_len": ref,
            "note": "one chain step; a depth-D chain costs D-1 steps",
            # a whole proposal by (speculating requests, drafts), right after a verified round
            "propose_ms": time_draft_proposals(
                draft_model, spec_counts, drafts, spec_repeats, context_len=ref, bench=bench
            ),
            # catching up a whole prompt (after a prefill): one eager forward of its rows
            "catchup_rows_ms": time_draft_catchup(
                draft_model,
                catchup_profile_rows(engine.max_model_len),
                max(1, repeats // 2),
                rows_per_req=CATCHUP_PROMPT_ROWS,
            ),
            # proposals at longer contexts: the draft KV every step reads
            **_draft_kv_fields(
                draft_model, spec_counts, spec_depth, ref, engine, spec_repeats, ex, bench
            ),
            # a graphed drafter catches up in passes (DraftModelDrafter._step0)
            **(
                {
                    "catchup_rows_per_pass": passes,
                    "max_catchup_passes": getattr(inner, "max_catchup_passes", MAX_CATCHUP_PASSES),
                }
                if passes
                else {}
            ),
            # ... and runs longer ones in wide passes padded to these row buckets (_wide_rows)
            **(
                {
                    "catchup_pass_rows": int(inner.wide_pass_rows),
                    "catchup_pass_buckets": [int(b) for b in inner.wide_buckets],
                }
                if getattr(inner, "wide_buckets", ())
                else {}
            ),
        }
    if host_overhead and engine.drafter is not None:
        # the speculating terms above put together as the engine runs them (after them: the
        # ratio is against their price)
        profile["target"]["spec_round_ratio"] = time_spec_round_ratio(
            engine, profile, _host_points(ex.max_slots), ref
        )
    return profile


def main(argv: list[str] | None = None) -> int:
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    ap = argparse.ArgumentParser(prog="hipfire-serve profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--spec-depth", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="auto")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)))
    ap.add_argument("--kv-lens", default=",".join(map(str, DEFAULT_KV_LENS)))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--graphs", default="lazy", choices=("lazy", "off"))
    ap.add_argument("--out", default="", help="output JSON (default: the profile cache)")
    args = ap.parse_args(argv)
    try:
        engine = Engine(
            EngineConfig(
                model=args.model,
                draft=args.draft,
                device=args.device,
                dtype=args.dtype,
                max_concurrency=args.max_concurrency,
                spec_depth=args.spec_depth,
                kv_cache_memory=args.kv_cache_memory,
                graphs=args.graphs,
                spec_mode="ar",
            )
        )
        rows = tuple(int(x) for x in args.rows.split(","))
        kv_lens = tuple(int(x) for x in args.kv_lens.split(","))
    except (ValueError, OSError) as e:
        print(f"hipfire-serve profile: {e}", file=sys.stderr)
        return 2
    profile = build_profile(engine, rows, kv_lens, args.repeats)
    key = profile_key(
        str(engine.target_dir),
        engine.draft_spec,
        engine.device,
        engine.target.dtype,
        engine.config.block_size,
        engine.config.max_concurrency,
    )
    profile["key"] = key
    out = Path(args.out) if args.out else cached_profile_path(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1))
    print(f"{'rows':>6} {'ms':>9}")
    for n, ms in profile["target"]["rows_ms"]:
        print(f"{n:>6} {ms:>9.3f}")
    print(f"KV read rate {profile['target']['kv_read_TBps_assumed']} TB/s; wrote {out}")
    return 0
