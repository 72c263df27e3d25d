"""Whole executor rounds timed on synthetic plans: decode rounds of AR rows or speculative groups
at a given context (`RoundTimer`), rounds of prefill chunks, and AR rounds run back to back
ahead of each other as the engine runs them (`time_rounds_ahead`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from executor.drafters.base import DraftBatch
from executor.profiling.device import sync_device
from executor.round_executor import RoundExecutor
from scheduler.kv_blocks import BlockPool
from scheduler.plan import Mode, ReqPlan, RoundPlan, SamplingSpec, SeqSetup

# Prefill chunks timed for the profile (`target.prefill_rows_ms`), up to the round's prefill
# budget plus a decode row per slot: rounds with a chunk run eagerly, so the graphed decode
# rounds' curve does not price them. 32 rows: the floor of an eager round, bound by launching
# its kernels (a prompt's short last chunk), which the cost model keeps flat below the first point.
PREFILL_ROWS = (32, 256, 1024, 2048, 4096)
PREFILL_CHUNK_ROWS = 1024  # tokens per prompt in those rounds (a typical prompt)


class RepeatDrafter:
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

    def extend_context(self, target_hidden, positions, slot_mapping):
        pass  # a block drafter's context write is profiled on its own (time_context_write)


def stand_in(ex: RoundExecutor, drafter):
    """The drafter a profiled round runs with: `drafter`, or where that is None and the
    executor captures hidden states for a block drafter (it then hands every forward's to
    its drafter), a RepeatDrafter, whose context write costs nothing."""
    return RepeatDrafter() if drafter is None and ex.capture is not None else drafter


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


def _set_up(ex: RoundExecutor, setups=(), release=()) -> None:
    """The executor's slots set up for `setups` / released, as a plan's would be."""
    ex.apply_setup_release(RoundPlan(round_id=0, setup=tuple(setups), release=tuple(release)))


class RoundTimer:
    """Builds synthetic decode rounds (AR rows, or SPEC groups once rows exceed the slots) at a
    given context length and times `RoundExecutor.run` on them."""

    def __init__(self, executor: RoundExecutor, spec_depth: int):
        self.ex = executor
        self.spec_depth = spec_depth
        self.pool = BlockPool(executor.kv.num_blocks, executor.block_size)
        self.last_phases: dict[str, float] = {}  # median phase times (ms) of the last shape

    def random_setups(self, num_seqs: int, kv_len: int, new_tokens: int, seed: int):
        """`random_setups` on this timer's executor and block pool."""
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
        setups, blocks = self.random_setups(num_seqs, top, rows_per_seq, num_rows * 7919 + top)
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
        drafter = RepeatDrafter() if rows_per_seq > 1 else None
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
        setups, blocks = self.random_setups(len(sizes), max(sizes), 1, num_rows * 7919 + 3)
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
        saved_drafter, ex.drafter = ex.drafter, stand_in(ex, drafter)
        _set_up(ex, setups=setups)
        slots = tuple(slot for slot, _, _ in states)
        times, phases = [], []
        try:
            for i in range(repeats + 2):
                for slot, context_len, computed in states:
                    ex.rewind(slot, context_len, num_computed=computed)
                sync_device(ex.device)
                t0 = time.perf_counter()
                result = ex.run(plan)
                sync_device(ex.device)
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
                    phases.append(result.timings)
        finally:
            _set_up(ex, release=slots)
            ex.drafter = saved_drafter
            for slot in slots:
                self.pool.free(slot)
        return times, phases


def time_prefill_rows(
    timer: RoundTimer, repeats: int, max_prefill_tokens: int, max_model_len: int
) -> list[list[float]]:
    """[[rows, ms], ...] rounds of prefill chunks (`RoundTimer.time_prefill_round`, prompts of
    at most PREFILL_CHUNK_ROWS tokens and `max_model_len` - 1) at the PREFILL_ROWS up to the
    prefill budget `max_prefill_tokens` plus a row per slot (and the budget itself), those the
    KV blocks and slots hold."""
    ex = timer.ex
    top = max_prefill_tokens + ex.max_slots
    chunk = min(PREFILL_CHUNK_ROWS, max_model_len - 1)
    out = []
    for n in sorted({r for r in PREFILL_ROWS if r < top} | {max_prefill_tokens}):
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
    setups, blocks = timer.random_setups(num_rows, kv_len, num_rounds, num_rows * 7919 + kv_len + 1)
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
    saved_drafter, ex.drafter = ex.drafter, stand_in(ex, None)
    _set_up(ex, setups=setups)
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
        _set_up(ex, release=range(num_rows))
        ex.drafter = saved_drafter
        for slot in range(num_rows):
            timer.pool.free(slot)
    periods = np.diff(ends[2:]) * 1e3  # after two rounds of warm-up
    return float(np.median(periods))
