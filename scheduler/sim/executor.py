"""The simulator's executor: runs a RoundPlan without a device.

Round time = the profile's cost of the executed shape (bucket-padded rows, KV term, drafter
chain with the catch-up rows it really needs) x an optional systematic scale (a device that
differs from its profile) x log-normal noise. Acceptance comes from the hidden two-state model.
Emitted tokens are a fixed function of (req_id, output index), the way greedy decoding is a
fixed function of the context: whatever the policy does, a request's outputs must come out the
same, which the tests check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

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
        drafter_prefill: bool = True,
        token_fn: Callable[[int, int], int] = default_token,
    ):
        self.profile = profile
        self.acceptance = AcceptanceState(classes, num_slots, seed + 1)
        self.rng = np.random.default_rng(seed + 2)
        self.noise_sigma = noise_sigma
        self.time_scale = time_scale
        self.drafter_prefill = drafter_prefill
        self.token_fn = token_fn
        self.slot_req = np.full(num_slots, -1, dtype=np.int64)  # [slots] req_id or -1
        self.slot_next_index = np.zeros(num_slots, dtype=np.int64)  # [slots] next output index
        self.slot_lag = np.zeros(num_slots, dtype=np.int64)  # [slots] tokens the drafter missed
        self.slot_context_len = np.zeros(num_slots, dtype=np.int64)
        self.slot_logprobs = np.zeros(num_slots, dtype=bool)  # [slots] request wants logprobs

    def true_round_ms(self, num_rows, num_kv_tokens, depth, num_spec, lag, prefill_rows) -> float:
        return float(
            self.profile.round_ms(
                num_rows, num_kv_tokens, depth, num_spec, lag, prefill_rows, self.drafter_prefill
            )
        )

    def run(self, plan: RoundPlan) -> RoundResult:
        for slot in plan.release:
            req_id = int(self.slot_req[slot])
            if req_id >= 0:
                self.acceptance.leave(slot, req_id)
            self.slot_req[slot] = -1
        for setup in plan.setup:
            assert self.slot_req[setup.slot] == -1, f"slot {setup.slot} set up while in use"
            self.slot_req[setup.slot] = setup.req_id
            self.slot_next_index[setup.slot] = setup.num_output_tokens
            self.slot_lag[setup.slot] = 0
            self.slot_context_len[setup.slot] = len(setup.context_token_ids)
            self.slot_logprobs[setup.slot] = setup.sampling.logprobs is not None
            self.acceptance.enter(setup.slot, setup.req_id)

        spec = [r for r in plan.reqs if r.mode == Mode.SPEC]
        spec_slots = np.array([r.slot for r in spec], dtype=np.int64)
        spec_draft = np.array([r.num_draft for r in spec], dtype=np.int64)
        lag = int(self.slot_lag[spec_slots].sum()) if len(spec) else 0
        accepted = self.acceptance.run_chains(spec_slots, spec_draft) if len(spec) else []
        accepted_of = {r.req_id: int(a) for r, a in zip(spec, accepted)}
        ar_slots = [
            r.slot for r in plan.reqs if r.mode == Mode.AR or (r.mode == Mode.PREFILL and r.sample)
        ]
        if ar_slots:
            self.acceptance.step_tokens(
                np.array(ar_slots, dtype=np.int64), np.ones(len(ar_slots), dtype=np.int64)
            )

        results = []
        num_prefill_rows = 0
        for r in plan.reqs:
            assert self.slot_req[r.slot] == r.req_id, f"slot {r.slot} does not hold {r.req_id}"
            if r.mode == Mode.PREFILL:
                num_prefill_rows += r.num_new
                num_emit = 1 if r.sample else 0
                self.slot_lag[r.slot] = 0
            elif r.mode == Mode.AR:
                num_emit = 1
                self.slot_lag[r.slot] += 1
            else:
                num_emit = 1 + accepted_of[r.req_id]
                self.slot_lag[r.slot] = 0
            start = int(self.slot_next_index[r.slot])
            tokens = tuple(self.token_fn(r.req_id, start + i) for i in range(num_emit))
            self.slot_next_index[r.slot] = start + num_emit
            results.append(
                ReqResult(
                    req_id=r.req_id,
                    token_ids=tokens,
                    num_drafted=r.num_draft,
                    num_accepted=accepted_of.get(r.req_id, 0),
                    logprobs=self._logprobs(tokens) if self.slot_logprobs[r.slot] else None,
                )
            )

        rows = plan.row_bucket or plan.num_rows
        depth = plan.spec_depth - 1 if spec else 0
        ms = (
            self.true_round_ms(rows, plan.num_kv_tokens, depth, len(spec), lag, num_prefill_rows)
            if plan.reqs
            else 0.0
        )
        if self.time_scale is not None and plan.reqs:
            ms *= self.time_scale(plan.num_rows, bool(spec))
        if self.noise_sigma > 0 and plan.reqs:
            ms *= float(np.exp(self.rng.normal(0.0, self.noise_sigma)))
        return RoundResult(
            round_id=plan.round_id,
            reqs=tuple(results),
            timings=PhaseTimes(forward_ms=ms, total_ms=ms),
            num_rows=plan.num_rows,
            num_padded_rows=rows,
            num_kv_tokens=plan.num_kv_tokens,
            graph_replayed=plan.row_bucket > 0,
        )

    def _logprobs(self, tokens: tuple[int, ...]) -> tuple[TokenLogprob, ...] | None:
        return tuple(TokenLogprob(t, -0.5) for t in tokens)
