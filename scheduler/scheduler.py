"""The scheduler: slot pool, request lifecycle, KV block accounting, admission and the per-round
speculative/AR choice. Torch-free; the engine drives it:

    plan = scheduler.plan(now); result = executor.run(plan); deltas = scheduler.update(result, now)

Lifecycle: WAITING -> (admitted into a free slot) PREFILLING -> (last chunk samples the first
token) DECODING -> FINISHED; ABORTED from any state. A finished, aborted or preempted request's
slot and KV blocks go back in the next plan's `release`. A slot released by a plan is reused from
the following plan on, so an executor may apply `release` and `setup` in either order.

KV: before a round the scheduler allocates blocks for every position the round writes (prefill
chunk; AR row; SPEC row + drafts); after it frees blocks past the committed length. When even
the AR rows do not fit, the most recently admitted decoding requests are preempted (their
context is recomputed later by PREFILL chunks); the longest-running ones are protected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.cost_model import CostModel, ProfileCost
from scheduler.kv_blocks import BlockPool, num_blocks_for
from scheduler.plan import Mode, ReqPlan, RoundPlan, RoundResult, SeqSetup
from scheduler.policy import (
    HYSTERESIS,
    MIN_DWELL_ROUNDS,
    AdaptivePolicy,
    AllARPolicy,
    AllSpecPolicy,
    DecodeView,
    RateTracker,
    SpecPolicy,
)
from scheduler.request import SPECULATION_CHOICES, ReqState, Request, RequestDelta, RequestSpec
from scheduler.tenants import FairAdmission, TenantSpec

StopChecker = Callable[[int, Sequence[int]], "tuple[int, str] | None"]


_SPECULATION_CODE = {"off": 0, "auto": 1, "on": 2}


class QueueFullError(RuntimeError):
    """The backlog is at --max-queue; the server answers 503."""


def _f(default, help_: str):
    return field(default=default, metadata={"help": help_})


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_concurrency: int = _f(64, "live slot capacity")
    max_queue: int = _f(1024, "waiting requests beyond which add_request raises QueueFullError")
    spec_mode: str = _f("adaptive", "adaptive | spec | ar")
    spec_depth: int = _f(8, "rows per speculating request at most (drafts + 1)")
    block_size: int = _f(16, "tokens per KV block")
    max_prefill_tokens: int = _f(2048, "prefill rows per round (chunked prefill budget)")
    max_model_len: int = _f(0, "prompt + max_tokens limit; 0: only the KV capacity limits")
    has_drafter: bool = _f(True, "a drafter is loaded; without one no round speculates")
    drafter_follows_prefill: bool = _f(
        False,
        "the drafter computes prefill chunks alongside the target; otherwise (the executor's "
        "draft-model drafter) it catches up on the whole context at a request's first SPEC "
        "round",
    )
    prior_acceptance: float = _f(0.7, "drafter acceptance assumed before any observation")
    kv_watermark: float = _f(
        0.01, "fraction of KV blocks kept free at admission, headroom for decode growth"
    )
    hysteresis: float = _f(HYSTERESIS, "relative estimate margin needed to switch a request")
    min_dwell_rounds: int = _f(MIN_DWELL_ROUNDS, "rounds a request keeps a new mode")

    def validate(self) -> None:
        if self.spec_mode not in ("adaptive", "spec", "ar"):
            raise ValueError(f"spec_mode must be adaptive, spec or ar, got {self.spec_mode!r}")
        if self.max_concurrency < 1 or self.spec_depth < 1 or self.block_size < 1:
            raise ValueError("max_concurrency, spec_depth and block_size must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")

    @property
    def max_drafts(self) -> int:
        return self.spec_depth - 1 if self.has_drafter and self.spec_mode != "ar" else 0


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True):
    round_id: int
    num_running: int
    num_waiting: int
    num_prefilling: int
    num_decoding: int
    kv_usage: float
    route: str
    num_spec: int  # k: speculating requests in the last round
    spec_depth: int  # deepest chain of the last round (rows per spec request)
    predicted_ms: float
    measured_ms: float
    reason: str
    num_policy_switches: int  # requests that changed AR <-> SPEC, total
    num_preemptions: int
    num_drafted: int
    num_accepted: int


def _default_cost_model() -> CostModel:
    """A flat model for tests without a profile: 10 ms per round plus 0.01 ms per row."""
    profile = {
        "target": {
            "rows_ms": [[1, 10.0], [4096, 10.0 + 0.01 * 4095]],
            "kv_bytes_per_token": 0,
            "kv_read_TBps_assumed": 1.0,
        },
        "draft_model": {"rows_ms_per_step": [[1, 1.0], [4096, 2.0]]},
    }
    return CostModel(ProfileCost(profile))


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        cost_model: CostModel | None = None,
        tenants: Sequence[TenantSpec] = (),
        stop_checker: StopChecker | None = None,
        policy: SpecPolicy | None = None,
    ):
        config.validate()
        self.config = config
        self.kv = BlockPool(num_kv_blocks, config.block_size)
        self.cost_model = cost_model or _default_cost_model()
        self.cost_model.drafter_prefill = config.drafter_follows_prefill and config.max_drafts > 0
        self.admission = FairAdmission(tenants)
        self.stop_checker = stop_checker
        if policy is None:
            policy = {
                "adaptive": AdaptivePolicy(config.hysteresis, config.min_dwell_rounds),
                "spec": AllSpecPolicy(),
                "ar": AllARPolicy(),
            }[config.spec_mode]
        self.policy = policy
        self.estimator = AcceptanceEstimator(
            config.max_concurrency, max(config.spec_depth - 1, 1), config.prior_acceptance
        )
        self._requests: dict[int, Request] = {}  # every request not yet released
        self._live: list[Request] = []  # requests holding a slot, in admission order
        self._free_slots: list[int] = list(range(config.max_concurrency - 1, -1, -1))
        self._to_release: list[Request] = []  # finished/aborted/preempted, freed by next plan
        self._inflight: dict[int, ReqPlan] = {}
        self._setups: list[SeqSetup] = []  # setups of the plan being made
        self._round_id = 0
        self._admit_seq = 0
        self._cohort_changed = True
        self._last_raw_ms = 0.0
        self._last_extra_tokens = 0.0
        self._last_reason = ""
        self._last_plan: RoundPlan | None = None
        self._last_measured_ms = 0.0
        self.rate_tracker = RateTracker()
        self._round_ar_rate = 0.0  # tokens per ms of the last plan's all-AR alternative
        self._num_switches = 0
        self._num_preemptions = 0
        self._num_drafted = 0
        self._num_accepted = 0

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, spec: RequestSpec) -> None:
        if spec.req_id in self._requests:
            raise ValueError(f"request {spec.req_id} already exists")
        if spec.speculation not in SPECULATION_CHOICES:
            raise ValueError(f"speculation must be off, on or auto, got {spec.speculation!r}")
        if not spec.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if spec.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {spec.max_tokens}")
        total_len = len(spec.prompt_token_ids) + spec.max_tokens
        if self.config.max_model_len and total_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(spec.prompt_token_ids)} tokens) + max_tokens ({spec.max_tokens}) "
                f"exceeds the model's context length {self.config.max_model_len}"
            )
        if num_blocks_for(total_len, self.kv.block_size) > self.kv.num_total:
            raise ValueError(
                f"prompt + max_tokens ({total_len} tokens) exceeds the whole KV cache "
                f"({self.kv.num_total * self.kv.block_size} tokens)"
            )
        if self.admission.num_waiting >= self.config.max_queue:
            raise QueueFullError(f"queue full ({self.config.max_queue} waiting)")
        req = Request(spec)
        self._requests[spec.req_id] = req
        self.admission.push(req)

    def abort(self, req_id: int) -> None:
        """Ends the request in any state; its slot and blocks go back in the next plan."""
        req = self._requests.get(req_id)
        if req is None or req.is_done:
            return
        if req.state == ReqState.WAITING:
            self.admission.remove(req)
            req.state = ReqState.ABORTED
            req.finish_reason = "abort"
            self.kv.free(req_id)
            del self._requests[req_id]
            return
        req.state = ReqState.ABORTED
        req.finish_reason = "abort"
        self._to_release.append(req)

    def has_work(self) -> bool:
        return bool(self._live or self.admission.num_waiting or self._to_release)

    # ---------------------------------------------------------------- planning

    def _release(self, released: list[int]) -> None:
        for req in self._to_release:
            if req.slot < 0:
                continue
            self.kv.free(req.req_id)
            released.append(req.slot)
            self.admission.on_release(req.spec.tenant)
            req.slot = -1
            if req.is_done:
                self._requests.pop(req.req_id, None)
        if self._to_release:
            live_before = len(self._live)
            self._live = [r for r in self._live if r.is_live and r.slot >= 0]
            self._cohort_changed |= len(self._live) != live_before
        self._to_release = []

    def _preempt(self, req: Request, released: list[int]) -> None:
        """Back to the front of its tenant's queue; recomputed from its context later."""
        self.kv.free(req.req_id)
        setup_now = [s for s in self._setups if s.req_id == req.req_id]
        if setup_now:  # admitted by this very plan: the executor never hears of it
            self._setups.remove(setup_now[0])
            self._free_slots.append(req.slot)
        else:
            released.append(req.slot)
        self.admission.on_release(req.spec.tenant)
        req.slot = -1
        req.state = ReqState.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.admission.push(req, front=True)
        self._live.remove(req)
        self._cohort_changed = True

    def _admit(self, setups: list[SeqSetup], now: float) -> None:
        cfg = self.config
        if not self._free_slots or not self.admission.num_waiting:
            return  # the common case of a full server: no per-request work
        reserve = int(cfg.kv_watermark * self.kv.num_total) + sum(
            num_blocks_for(r.num_prefill_target + 1, self.kv.block_size)
            - self.kv.num_blocks_of(r.req_id)
            for r in self._live
            if r.state == ReqState.PREFILLING
        )
        while self._free_slots and len(self._live) < cfg.max_concurrency:
            req = self.admission.peek()
            if req is None:
                return
            need = num_blocks_for(req.context_len + 1, self.kv.block_size)
            if need > self.kv.num_free - reserve and self._live:
                return  # wait for blocks; an empty server admits anyway (it fits alone)
            self.admission.pop(req)
            reserve += need
            req.slot = self._free_slots.pop()
            req.state = ReqState.PREFILLING
            req.num_computed = 0
            req.num_prefill_target = req.context_len
            req.admit_seq = self._admit_seq
            self._admit_seq += 1
            req.admit_time = now
            req.last_mode = Mode.PREFILL  # no decode decision yet
            req.mode_since_round = self._round_id
            req.drafter_lag = 0
            self.estimator.reset(req.slot)
            self._live.append(req)
            self._cohort_changed = True
            setups.append(
                SeqSetup(
                    req_id=req.req_id,
                    slot=req.slot,
                    context_token_ids=req.context_token_ids(),
                    sampling=req.spec.sampling,
                    num_output_tokens=req.num_output,
                )
            )

    def _reserve(self, req: Request, num_tokens: int, released: list[int]) -> bool:
        """Allocates blocks covering `num_tokens` positions of `req`, preempting the most
        recently admitted other requests when the pool is short. Older requests are protected:
        returns False (nothing allocated) when only they could make room."""
        need = num_blocks_for(num_tokens, self.kv.block_size) - self.kv.num_blocks_of(req.req_id)
        while need > self.kv.num_free:
            victim = max(
                (r for r in self._live if r is not req),
                key=lambda r: r.admit_seq,
                default=None,
            )
            if victim is None or victim.admit_seq < req.admit_seq:
                return False
            self._preempt(victim, released)
        if need > 0:
            self.kv.allocate(req.req_id, need)
        return True

    def plan(self, now: float) -> RoundPlan:
        self._round_id += 1
        round_id = self._round_id
        cfg = self.config
        released: list[int] = []
        self._release(released)
        setups: list[SeqSetup] = []
        self._setups = setups
        self._admit(setups, now)

        # Prefill chunks, oldest admission first, within the token budget.
        budget = cfg.max_prefill_tokens
        prefills: list[tuple[Request, int]] = []
        prefilling: list[Request] = []
        decoding: list[Request] = []
        for req in self._live:  # one pass: both lists keep admission order
            if req.state == ReqState.DECODING:
                decoding.append(req)
            elif req.state == ReqState.PREFILLING:
                prefilling.append(req)
        for req in prefilling:
            if budget <= 0:
                break
            if req.slot < 0:
                continue  # preempted to make room for an older request
            chunk = min(req.num_prefill_target - req.num_computed, budget)
            if not self._reserve(req, req.num_computed + chunk, released):
                break
            prefills.append((req, chunk))
            budget -= chunk

        # Decode rows: every decoding request gets at least its AR row, oldest first.
        decoders: list[Request] = []
        bs = self.kv.block_size
        tables = self.kv.tables
        num_preempted = self._num_preemptions
        for req in decoding:
            if req.slot < 0:
                continue  # preempted to make room for a prefill chunk
            # fast path: the block of the AR row's position is already held
            held = tables.get(req.req_id)
            has_block = held is not None and req.num_computed < len(held) * bs
            if has_block or self._reserve(req, req.num_computed + 1, released):
                decoders.append(req)
        if self._num_preemptions != num_preempted:  # some were preempted to make room
            decoders = [r for r in decoders if r.slot >= 0]
            prefills = [(r, c) for r, c in prefills if r.slot >= 0]

        num_draft = self._decide(decoders, prefills)
        reqs, route, total_rows, kv_tokens, d_max, lag = self._build_reqs(
            decoders, prefills, num_draft
        )
        num_spec = sum(1 for d in num_draft if d > 0)
        num_prefill_rows = sum(c for _, c in prefills)
        predicted_ms = 0.0
        self._last_raw_ms = 0.0
        if reqs:
            cm = self.cost_model
            self._last_raw_ms = cm.raw_ms_scalar(
                total_rows, kv_tokens, d_max, num_spec, lag, num_prefill_rows
            )
            predicted_ms = cm.predict_ms_scalar(
                total_rows, kv_tokens, d_max, num_spec, lag, num_prefill_rows
            )
        predicted_tokens = float(len(decoders)) + float(
            sum(1 for r, c in prefills if r.num_computed + c == r.num_prefill_target)
        )
        plan = RoundPlan(
            round_id=round_id,
            setup=tuple(setups),
            release=tuple(released),
            reqs=tuple(reqs),
            num_rows=total_rows,
            row_bucket=self._row_bucket(total_rows, prefills),
            num_kv_tokens=kv_tokens,
            spec_depth=d_max + 1,
            predicted_ms=predicted_ms,
            predicted_tokens=predicted_tokens + self._last_extra_tokens,
            route=route,
            reason=self._last_reason,
        )
        self._last_plan = plan
        self._cohort_changed = False
        # Slots released by this plan become reusable from the next plan on.
        self._free_slots.extend(released)
        return plan

    def _row_bucket(self, num_rows: int, prefills) -> int:
        """Graph bucket of a decode-only round; prefill rounds and rows past the largest bucket
        run eagerly (0)."""
        buckets = self.cost_model.profile.row_buckets
        if prefills or num_rows == 0 or num_rows > buckets[-1]:
            return 0
        return int(self.cost_model.profile.bucket(num_rows))

    def _decide(self, decoders: list[Request], prefills) -> list[int]:
        n = len(decoders)
        self._last_extra_tokens = 0.0
        self._round_ar_rate = 0.0
        if n == 0 or self.config.max_drafts == 0:
            self._last_reason = "no decoding request" if n == 0 else "no speculation"
            return [0] * n
        cfg = self.config
        # One pass over the requests into a [n, 7] table: the rest is array work.
        spec_code = _SPECULATION_CODE
        flat: list[int] = []
        for r in decoders:
            flat += (
                r.spec.req_id,
                r.slot,
                r.spec.max_tokens - len(r.output_token_ids),
                r.drafter_lag,
                spec_code[r.spec.speculation],
                r.last_mode,
                r.mode_since_round,
                r.num_computed,
            )
        table = np.array(flat, dtype=np.int64).reshape(n, 8)  # [n, 8]
        remaining = table[:, 2]
        # Drain: nobody waits and slots are free, so capacity is not what limits the server;
        # the live requests finishing is. The last to finish sets the makespan, so a token is
        # worth its request's share of the largest remaining work.
        draining = self.admission.num_waiting == 0 and len(self._live) < cfg.max_concurrency
        if draining:
            weights = remaining / max(int(remaining.max()), 1)
        else:
            weights = np.ones(n)
        num_prefill_rows = sum(c for _, c in prefills)
        prefill_done = sum(1 for r, c in prefills if r.num_computed + c == r.num_prefill_target)
        base_rows = n + num_prefill_rows
        base_kv_tokens = int(table[:, 7].sum()) + n + sum(r.num_computed + c for r, c in prefills)
        base_tokens = float(weights.sum()) + prefill_done
        ar_ms = self.cost_model.predict_ms_scalar(
            base_rows, base_kv_tokens, 0, 0, 0, num_prefill_rows
        )
        # Only decode-only rounds feed the rate bar (see RateTracker): with a prefill chunk in
        # the round, drafts ride on an expensive eager forward and the uplift over AR is far
        # above what decode rounds can reach.
        self._round_ar_rate = 0.0 if prefills else n / ar_ms
        view = DecodeView(
            req_ids=table[:, 0],
            slots=table[:, 1],
            num_remaining=remaining,
            drafter_lag=table[:, 3],
            may_spec=table[:, 4] > 0,
            must_spec=table[:, 4] == 2,
            was_spec=table[:, 5] == Mode.SPEC,
            # a request's first decode round has no mode to hold on to yet
            in_dwell=(self._round_id - table[:, 6] < cfg.min_dwell_rounds)
            & (table[:, 5] != Mode.PREFILL),
            weights=weights,
            max_drafts=cfg.max_drafts,
            base_rows=base_rows,
            base_kv_tokens=base_kv_tokens,
            base_tokens=base_tokens,
            num_prefill_rows=num_prefill_rows,
            num_live=len(self._live),
            cohort_changed=self._cohort_changed,
            draining=draining,
            rate_bar=self.rate_tracker.uplift * base_tokens / ar_ms,
        )
        decision = self.policy.decide(view, self.estimator, self.cost_model)
        self._last_reason = decision.reason
        num_draft = np.asarray(decision.num_draft, dtype=np.int64)
        if num_draft.any():
            # expected extra tokens by the estimators, whatever policy chose the depths
            survival = self.estimator.survival(view.slots)[:, : cfg.max_drafts]  # [n, D]
            taken = np.arange(cfg.max_drafts)[None, :] < num_draft[:, None]
            self._last_extra_tokens = float((survival * taken).sum())
        return num_draft.tolist()

    def _build_reqs(self, decoders, prefills, num_draft):
        reqs: list[ReqPlan] = []
        letters: list[str] = []
        total_rows = kv_tokens = d_max = lag = 0
        kv = self.kv
        bs = kv.block_size
        tables = kv.tables
        inflight = self._inflight
        round_id = self._round_id
        spec, ar, prefill = Mode.SPEC, Mode.AR, Mode.PREFILL
        # Every draft needs at most ceil(d / bs) + 1 new blocks; when the pool holds that for
        # everyone, the per-request "does it fit" check is skipped (the common case).
        max_new = len(decoders) * (-(-max(num_draft, default=0) // bs) + 1)
        roomy = max_new <= kv.num_free
        for req, d in zip(decoders, num_draft):
            rid = req.req_id
            num_computed = req.num_computed
            held = tables[rid]  # plan() made sure the AR row's block is held
            if d > 0:
                need = -(-(num_computed + 1 + d) // bs) - len(held)
                # drafts whose KV does not fit are dropped, never an error
                while not roomy and d > 0 and need > kv.num_free:
                    d -= 1
                    need = -(-(num_computed + 1 + d) // bs) - len(held)
                if need > 0 and d > 0:
                    kv.allocate(rid, need)  # appends to `held` in place
            if d > 0:
                mode = spec
                lag += req.drafter_lag
                if d > d_max:
                    d_max = d
            else:
                mode = ar
            num_new = 1 + d
            # The table is exactly ceil(num_computed / bs) long after update(); every block
            # past that was allocated for this round (AR row in plan(), drafts here).
            offset = -(-num_computed // bs)  # num_blocks_for, inlined (hot loop)
            new_ids = tuple(held[offset:]) if len(held) > offset else ()
            if mode != req.last_mode:
                if req.last_mode != prefill:  # the first decision is not a switch
                    self._num_switches += 1
                req.last_mode = mode
                req.mode_since_round = round_id
            plan = ReqPlan(
                req_id=rid,
                slot=req.slot,
                mode=mode,
                num_computed=num_computed,
                num_new=num_new,
                num_draft=d,
                block_offset=offset,
                new_block_ids=new_ids,
            )
            reqs.append(plan)
            letters.append("S" if d > 0 else "A")
            total_rows += num_new
            kv_tokens += num_computed + num_new
            inflight[rid] = plan
        for req, chunk in prefills:
            first_new = num_blocks_for(req.num_computed, bs)
            ids = kv.blocks_from(req.req_id, first_new)
            plan = ReqPlan(
                req_id=req.req_id,
                slot=req.slot,
                mode=Mode.PREFILL,
                num_computed=req.num_computed,
                num_new=chunk,
                block_offset=first_new,
                new_block_ids=ids,
                sample=req.num_computed + chunk == req.num_prefill_target,
            )
            reqs.append(plan)
            letters.append("P")
            total_rows += chunk
            kv_tokens += req.num_computed + chunk
            self._inflight[req.req_id] = plan
        return reqs, "".join(letters), total_rows, kv_tokens, d_max, lag

    # ---------------------------------------------------------------- results

    def update(self, result: RoundResult, now: float) -> list[RequestDelta]:
        measured_ms = result.timings.total_ms
        self._last_measured_ms = measured_ms
        if measured_ms > 0:
            self.admission.charge(measured_ms / 1e3)
            plan = self._last_plan
            if plan is not None and plan.round_id == result.round_id and self._last_raw_ms > 0:
                self.cost_model.observe(
                    plan.num_rows, plan.spec_depth > 1, self._last_raw_ms, measured_ms
                )
        self.estimator.decay()
        deltas: list[RequestDelta] = []
        spec_slots: list[int] = []
        spec_drafted: list[int] = []
        spec_accepted: list[int] = []
        for res in result.reqs:
            planned = self._inflight.pop(res.req_id, None)
            req = self._requests.get(res.req_id)
            if planned is None or req is None or not req.is_live or req.slot < 0:
                continue  # aborted or preempted meanwhile: its tokens are dropped
            if planned.mode == Mode.PREFILL:
                req.num_computed += planned.num_new
                if not planned.sample:
                    continue
                req.state = ReqState.DECODING
                # the drafter has seen the context only if it followed the prefill
                follows = self.config.drafter_follows_prefill
                req.drafter_lag = 0 if follows else req.num_prefill_target
                self._cohort_changed = True
            elif planned.mode == Mode.AR:
                req.num_computed += 1
                req.drafter_lag += 1
            else:
                num_acc = min(res.num_accepted, planned.num_draft)
                req.num_computed += 1 + num_acc
                req.drafter_lag = 0
                spec_slots.append(req.slot)
                spec_drafted.append(planned.num_draft)
                spec_accepted.append(num_acc)
                self._num_drafted += planned.num_draft
                self._num_accepted += num_acc
            deltas.append(self._commit_tokens(req, res, planned))
        if self._round_ar_rate > 0:
            num_tokens = sum(len(r.token_ids) for r in result.reqs)
            self.rate_tracker.observe(num_tokens, measured_ms, self._round_ar_rate)
        if spec_slots:
            self.estimator.observe(
                np.asarray(spec_slots), np.asarray(spec_drafted), np.asarray(spec_accepted)
            )
        self._inflight.clear()
        return deltas

    def _commit_tokens(self, req: Request, res, planned: ReqPlan) -> RequestDelta:
        spec = req.spec
        tokens = res.token_ids
        keep = len(tokens)
        finish: str | None = None
        stop_reason: int | str | None = None
        num_out = req.num_output
        for i, tok in enumerate(tokens):
            num_out += 1
            if num_out > spec.min_tokens:
                if tok in spec.stop_token_ids:
                    keep, finish, stop_reason = i + 1, "stop", tok
                    break
                if tok in spec.eos_token_ids:
                    keep, finish = i + 1, "stop"
                    break
            if num_out >= spec.max_tokens:
                keep, finish = i + 1, "length"
                break
        kept = tuple(tokens[:keep])
        if self.stop_checker is not None and kept:
            hit = self.stop_checker(req.req_id, kept)
            if hit is not None:
                keep, stop_reason = min(hit[0], keep), hit[1]
                finish = "stop"
                kept = kept[:keep]
        req.output_token_ids.extend(kept)
        logprobs = res.logprobs[:keep] if res.logprobs is not None else None
        if finish is not None:
            req.state = ReqState.FINISHED
            req.finish_reason = finish
            req.stop_reason = stop_reason
            self._to_release.append(req)
        else:
            self.kv.truncate_to(req.req_id, req.num_computed)
        return RequestDelta(
            req_id=req.req_id,
            token_ids=kept,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_drafted=planned.num_draft,
            num_accepted=min(res.num_accepted, planned.num_draft),
        )

    # ---------------------------------------------------------------- observability

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def request_state(self, req_id: int) -> ReqState | None:
        req = self._requests.get(req_id)
        return req.state if req is not None else None

    @property
    def stats(self) -> SchedulerStats:
        plan = self._last_plan
        return SchedulerStats(
            round_id=self._round_id,
            num_running=len(self._live),
            num_waiting=self.admission.num_waiting,
            num_prefilling=sum(1 for r in self._live if r.state == ReqState.PREFILLING),
            num_decoding=sum(1 for r in self._live if r.state == ReqState.DECODING),
            kv_usage=self.kv.usage,
            route=plan.route if plan else "",
            num_spec=plan.route.count("S") if plan else 0,
            spec_depth=plan.spec_depth if plan else 1,
            predicted_ms=plan.predicted_ms if plan else 0.0,
            measured_ms=self._last_measured_ms,
            reason=plan.reason if plan else "",
            num_policy_switches=self._num_switches,
            num_preemptions=self._num_preemptions,
            num_drafted=self._num_drafted,
            num_accepted=self._num_accepted,
        )
