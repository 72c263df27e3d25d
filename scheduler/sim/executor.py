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

from scheduler.cost_model import ProfileCost
from scheduler.plan import Mode, PhaseTimes, ReqResult, RoundPlan, RoundResult, TokenLogprob
from scheduler.sim.acceptance_model import AcceptanceClass, AcceptanceState


def default_token(req_id: int, index: int) -> int:
    """Deterministic 'greedy' token of a request at an output index (never below 1000, so
    tests can reserve small ids for EOS and stop tokens)."""
    return 1000 + (req_id * 1_000_003 + index * 7_919) % 30_000


class SimExecutor:
    def __init__(
        self,
        profile: ProfileCost,
        classes: tuple[AcceptanceClass, ...],
        num_slots: int,
        seed: int = 0,
        noise_sigma: float = 0.03,
        time_scale: Callable[[int, bool], float] | None = None,
        drafter_prefill: bool = False,
        token_fn: Callable[[int, int], int] = default_token,
        max_output_len: int = 8192,
    ):
        self.profile = profile
        self.acceptance = AcceptanceState(classes, seed, max_output_len + 64)
        self.rng = random.Random(seed + 2)
        self.noise_sigma = noise_sigma
        self.time_scale = time_scale
        self.drafter_prefill = drafter_prefill
        self.token_fn = token_fn
        self.slot_req = [-1] * num_slots  # req_id per slot, -1 free
        self.slot_next_index = [0] * num_slots  # next output index per slot
        self.slot_lag = [0] * num_slots  # tokens the drafter has not seen
        self.slot_logprobs = [False] * num_slots  # the request asked for logprobs

    def run(self, plan: RoundPlan) -> RoundResult:
        for slot in plan.release:
            self.acceptance.leave(slot)
            self.slot_req[slot] = -1
        for setup in plan.setup:
            assert self.slot_req[setup.slot] == -1, f"slot {setup.slot} set up while in use"
            self.slot_req[setup.slot] = setup.req_id
            self.slot_next_index[setup.slot] = setup.num_output_tokens
            self.slot_lag[setup.slot] = 0
            self.slot_logprobs[setup.slot] = setup.sampling.logprobs is not None
            self.acceptance.enter(setup.slot, setup.req_id)

        results = []
        num_prefill_rows = num_spec = lag = 0
        token_fn = self.token_fn
        for r in plan.reqs:
            slot = r.slot
            assert self.slot_req[slot] == r.req_id, f"slot {slot} does not hold {r.req_id}"
            start = self.slot_next_index[slot]
            accepted = 0
            if r.mode == Mode.PREFILL:
                num_prefill_rows += r.num_new
                num_emit = 1 if r.sample else 0
                # a drafter that does not follow prefills catches up on the whole context
                self.slot_lag[slot] = 0 if self.drafter_prefill else r.num_computed + r.num_new
            elif r.mode == Mode.AR:
                num_emit = 1
                self.slot_lag[slot] += 1
            else:
                num_spec += 1
                lag += self.slot_lag[slot]
                self.slot_lag[slot] = 0
                accepted = self.acceptance.accepted(slot, start, r.num_draft)
                num_emit = 1 + accepted
            tokens = tuple(token_fn(r.req_id, start + i) for i in range(num_emit))
            self.slot_next_index[slot] = start + num_emit
            results.append(
                ReqResult(
                    req_id=r.req_id,
                    token_ids=tokens,
                    num_drafted=r.num_draft,
                    num_accepted=accepted,
                    logprobs=tuple(TokenLogprob(t, -0.5) for t in tokens)
                    if self.slot_logprobs[slot]
                    else None,
                )
            )

        rows = plan.row_bucket or plan.num_rows
        ms = 0.0
        if plan.reqs:
            depth = plan.spec_depth - 1 if num_spec else 0
            ms = self.profile.round_ms_scalar(
                rows,
                plan.num_kv_tokens,
                depth,
                num_spec,
                lag,
                num_prefill_rows,
                self.drafter_prefill,
                padded=True,
            )
            if self.time_scale is not None:
                ms *= self.time_scale(plan.num_rows, num_spec > 0)
            if self.noise_sigma > 0:
                ms *= math.exp(self.rng.gauss(0.0, self.noise_sigma))
        return RoundResult(
            round_id=plan.round_id,
            reqs=tuple(results),
            timings=PhaseTimes(forward_ms=ms, total_ms=ms),
            num_rows=plan.num_rows,
            num_padded_rows=rows,
            num_kv_tokens=plan.num_kv_tokens,
            graph_replayed=plan.row_bucket > 0,
        )

    def next_positions(self, slots) -> list[int]:
        """Next output index of each slot (what the oracle's survival starts from)."""
        return [self.slot_next_index[s] for s in slots]
