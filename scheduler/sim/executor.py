"""The simulator's executor: runs a RoundPlan without a device.

Round time = the profile's cost of the executed shape (bucket-padded rows, KV term, drafter
chain with the catch-up rows it really needs) x an optional systematic scale (a device that
differs from its profile) x log-normal noise. Acceptance comes from the hidden two-state model.
Emitted tokens are a fixed function of (req_id, output index), the way greedy decoding is a
fixed function of the context: whatever the policy does, a request's outputs must come out the
same, which the tests check.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scheduler.cost_model import ProfileCost
from scheduler.plan import Emitted, PhaseTimes, RoundPlan, RoundResult, TokenLogprob, offsets
from scheduler.sim.acceptance_model import AcceptanceClass, AcceptanceState


def default_token(req_id: int, index: int) -> int:
    """Deterministic 'greedy' token of a request at an output index (never below 1000, so
    tests can reserve small ids for EOS and stop tokens)."""
    return 1000 + (req_id * 1_000_003 + index * 7_919) % 30_000


def default_tokens(req_ids: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """`default_token` over arrays (int64 arithmetic: ids and indices stay far below 2**40)."""
    return 1000 + (req_ids * 1_000_003 + indices * 7_919) % 30_000


@dataclass(frozen=True)
class RoundShape:
    """A round as the simulated executor prices it."""

    num_rows: int
    executed_rows: int  # as run: padded to the graph bucket, or eager
    num_kv_tokens: int
    draft_depth: int  # the deepest chain (0: no request speculates)
    num_spec: int
    num_draft_rows: int
    lag_rows: int  # context rows the speculating requests' drafters catch up on
    num_prefill_rows: int
    follow_prefill: bool  # the drafter computes the prefill chunks' draft KV alongside
    num_decoding: int
    decode_only: bool


class SimExecutor:
    def __init__(
        self,
        profile: ProfileCost,
        classes: tuple[AcceptanceClass, ...],
        num_slots: int,
        seed: int = 0,
        noise_sigma: float = 0.03,
        time_scale: Callable[[int, bool], float] | None = None,
        token_fn: Callable[[int, int], int] = default_token,
        trace_seed: int | None = None,
        trace_keys: tuple[int, ...] = (),
    ):
        self.profile = profile
        self.last_host_ms = 0.0  # the engine's host time around the last round (see run)
        # acceptance traces: seeded by `trace_seed` (default `seed`), keyed per request id by
        # `trace_keys` where given (a benchmark's prompts, to replay its runs' traces)
        self.acceptance = AcceptanceState(
            classes, seed if trace_seed is None else trace_seed, trace_keys
        )
        self.rng = random.Random(seed + 2)
        self.noise_sigma = noise_sigma
        self.time_scale = time_scale
        self.token_fn = token_fn
        self.slot_req = np.full(num_slots, -1, dtype=np.int64)  # req_id per slot, -1 free
        self.slot_next_index = np.zeros(num_slots, dtype=np.int64)  # next output index per slot
        self.slot_lag = np.zeros(num_slots, dtype=np.int64)  # tokens the drafter has not seen
        # prompt tokens whose draft KV the drafter computed alongside their prefill chunks
        self.slot_followed = np.zeros(num_slots, dtype=np.int64)
        self.slot_cached = np.zeros(num_slots, dtype=np.int64)  # prefix-cache hit at setup
        self.slot_logprobs = np.zeros(num_slots, dtype=bool)  # the request asked for logprobs
        # whether the last round with requests speculated (the next AR round pays the switch)
        self.last_speculated = False

    def run(self, plan: RoundPlan) -> RoundResult:
        for slot in plan.release:
            self.acceptance.leave(slot)
            self.slot_req[slot] = -1
        for setup in plan.setup:
            assert self.slot_req[setup.slot] == -1, f"slot {setup.slot} set up while in use"
            self.slot_req[setup.slot] = setup.req_id
            self.slot_next_index[setup.slot] = setup.num_output_tokens
            self.slot_lag[setup.slot] = 0
            self.slot_followed[setup.slot] = 0
            self.slot_cached[setup.slot] = setup.num_cached_tokens
            self.slot_logprobs[setup.slot] = setup.sampling.logprobs is not None
            self.acceptance.enter(setup.slot, setup.req_id)

        dec = plan.decode
        slots = dec.slots
        num_draft = dec.num_draft
        assert np.array_equal(self.slot_req[slots], dec.req_ids), "a slot does not hold its request"
        spec = num_draft > 0
        num_spec = int(np.count_nonzero(spec))
        lag = int(self.slot_lag[slots][spec].sum())
        start = self.slot_next_index[slots]  # [n] output index of each request's first token
        accepted = np.zeros(len(dec), dtype=np.int64)
        for i in np.flatnonzero(spec).tolist():  # the hidden acceptance model, per request
            accepted[i] = self.acceptance.accepted(int(slots[i]), int(start[i]), int(num_draft[i]))
        # a drafter catches up when its request speculates (but for the last draft of a fully
        # accepted chain, never fed), and falls behind by an AR token
        self.slot_lag[slots] = np.where(
            spec, (accepted == num_draft).astype(np.int64), self.slot_lag[slots] + 1
        )
        num_emit = 1 + accepted
        req_ids = list(dec.req_ids)
        firsts = list(start)
        counts = list(num_emit)
        drafted = list(num_draft)
        accepts = list(accepted)
        num_prefill_rows = 0
        for r in plan.prefills:
            slot = r.slot
            assert self.slot_req[slot] == r.req_id, f"slot {slot} does not hold {r.req_id}"
            num_prefill_rows += r.num_new
            # the drafter catches up on what of the context it did not follow (a chunk is
            # followed when the round says so and it continues the draft KV; the first chunk
            # after a cached prefix is followed from position 0)
            start = 0 if r.num_computed == self.slot_cached[slot] else r.num_computed
            if plan.follow_prefill and self.slot_followed[slot] == start:
                self.slot_followed[slot] = r.num_computed + r.num_new
            self.slot_lag[slot] = r.num_computed + r.num_new - self.slot_followed[slot]
            req_ids.append(r.req_id)
            firsts.append(self.slot_next_index[slot])
            counts.append(1 if r.sample else 0)
            drafted.append(0)
            accepts.append(0)
        all_slots = np.concatenate([slots, [r.slot for r in plan.prefills]]).astype(np.int64)
        counts_arr = np.asarray(counts, dtype=np.int64)
        self.slot_next_index[all_slots] += counts_arr
        token_req = np.repeat(np.asarray(req_ids, dtype=np.int64), counts_arr)
        token_index = np.repeat(np.asarray(firsts, dtype=np.int64), counts_arr) + (
            np.arange(int(counts_arr.sum())) - np.repeat(offsets(counts_arr)[:-1], counts_arr)
        )
        if self.token_fn is default_token:
            tokens = default_tokens(token_req, token_index)
        else:
            tokens = [self.token_fn(int(r), int(i)) for r, i in zip(token_req, token_index)]
        logprobs = {}
        if self.slot_logprobs[all_slots].any():
            starts = offsets(counts_arr)
            for i in np.flatnonzero(self.slot_logprobs[all_slots]).tolist():
                logprobs[i] = tuple(
                    TokenLogprob(int(t), -0.5) for t in tokens[starts[i] : starts[i + 1]]
                )
        out = Emitted.build(req_ids, counts_arr, tokens, drafted, accepts, logprobs)

        rows = plan.row_bucket or plan.num_rows
        ms = 0.0
        # the engine's host time around a speculating round: part of the round's period, not
        # of the executor's measured time (the scheduler calibrates against the latter)
        self.last_host_ms = 0.0
        if plan.num_reqs:
            shape = RoundShape(
                num_rows=plan.num_rows,
                executed_rows=rows,
                num_kv_tokens=plan.num_kv_tokens,
                draft_depth=plan.spec_depth - 1 if num_spec else 0,
                num_spec=num_spec,
                num_draft_rows=int(num_draft.sum()),
                lag_rows=lag,
                num_prefill_rows=num_prefill_rows,
                follow_prefill=plan.follow_prefill,
                num_decoding=len(plan.decode),
                decode_only=plan.is_decode_only,
            )
            ms, self.last_host_ms = self.round_cost_ms(shape)
            self.last_speculated = num_spec > 0
            if self.noise_sigma > 0:
                ms *= math.exp(self.rng.gauss(0.0, self.noise_sigma))
        return RoundResult(
            round_id=plan.round_id,
            out=out,
            timings=PhaseTimes(forward_ms=ms, total_ms=ms),
            num_rows=plan.num_rows,
            num_padded_rows=rows,
            num_kv_tokens=plan.num_kv_tokens,
            graph_replayed=plan.row_bucket > 0,
            # the simulator prices every AR-only decode round as run ahead (the engine's
            # steady state)
            overlapped=plan.is_decode_only and not plan.decode.num_draft.any(),
        )

    def round_cost_ms(self, shape: RoundShape) -> tuple[float, float]:
        """(executor ms, engine host ms) of a round of this shape after the one just run, noise
        left out: the round's period is their sum."""
        ms = self.profile.round_ms_scalar(
            shape.executed_rows,
            shape.num_kv_tokens,
            shape.draft_depth,
            shape.num_spec,
            shape.lag_rows,
            shape.num_prefill_rows,
            shape.follow_prefill,
            padded=True,
            num_draft_rows=shape.num_draft_rows,
            executor_only=True,
        )
        host_ms = 0.0
        if shape.draft_depth:
            host_ms = self.profile.round_spec_host_ms(
                shape.num_rows,
                shape.num_prefill_rows,
                shape.num_spec,
                shape.draft_depth,
                shape.num_draft_rows,
            )
        elif self.last_speculated and shape.decode_only:
            # the switch back to AR: this round starts the run-ahead pipeline anew
            host_ms = self.profile.ar_restart_ms_scalar(shape.num_decoding)
        if self.time_scale is not None:
            ms *= self.time_scale(shape.num_rows, shape.num_spec > 0)
        return ms, host_ms

    def next_positions(self, slots) -> list[int]:
        """Next output index of each slot (where the oracles read the acceptance traces)."""
        return [int(self.slot_next_index[s]) for s in slots]
