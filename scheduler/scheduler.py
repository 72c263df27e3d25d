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

Decoding requests keep the state the policy and the plan need in per-slot numpy arrays
(committed length, drafter lag, mode and since when, tokens left, KV blocks held), so plan()
builds the decode columns and update() applies a round with array operations; the `Request`
objects carry the rest (lifecycle, outputs) and the state of prefilling requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import numpy as np

from scheduler.acceptance import PROBE_CALIB_WEIGHT, AcceptanceEstimator, AcceptanceKnowledge
from scheduler.cost_model import CostModel, ProfileCost
from scheduler.kv_blocks import BlockPool, num_blocks_for
from scheduler.plan import DecodeRows, Mode, ReqPlan, RoundPlan, RoundResult, SeqSetup
from scheduler.policy import (
    HYSTERESIS,
    MIN_DWELL_ROUNDS,
    AdaptivePolicy,
    AllARPolicy,
    AllSpecPolicy,
    DecodeView,
    RateTracker,
    SpecPolicy,
    YieldTracker,
)
from scheduler.request import (
    SPECULATION_CHOICES,
    ReqState,
    Request,
    RequestSpec,
    RoundDeltas,
)
from scheduler.tenants import FairAdmission, TenantSpec

StopChecker = Callable[[int, Sequence[int]], "tuple[int, str] | None"]

FOLLOW_MODES = ("off", "on", "auto")  # SchedulerConfig.drafter_follows_prefill
# auto's answer is kept for prompts starting within this many rounds of it while the live batch
# keeps its size, within 1/FOLLOW_SIZE_TOLERANCE of it (exactly, below that many requests): the
# question is one search of the depth planner over every live request, and a refilled batch
# moves by a request or two between starts (simulator, code-like text, C = 64: 25 questions
# in 291 rounds with the size kept exactly, 4 within 1/8 of it, every answer the same at
# every point of the C = 1..128 grid). On the H200 (2026-11-30, C = 64) the planning phase of
# adaptive's rounds with prefill chunks was 1.55 ms with auto asked exactly, 1.44 ms within
# 1/8, 0.83-1.13 ms with off and 0.2-0.3 ms for all-AR: most of it is the policy's own plan.
FOLLOW_RECHECK_ROUNDS = 32
FOLLOW_SIZE_TOLERANCE = 8

_SPECULATION_CODE = {"off": 0, "auto": 1, "on": 2}
# a decode request's route letter from its speculating flag (a bool array's bytes)
_ROUTE_LETTERS = bytes.maketrans(b"\x00\x01", b"AS")


class _DeltaColumns:
    """Collects a round's deltas: the decode rows as whole columns, prefill rows one by one."""

    def __init__(self):
        self.parts: list[tuple] = []
        self.finish: dict[int, tuple[str, int | str | None]] = {}
        self.logprobs: dict = {}
        self.num_rows = 0

    def add_columns(self, req_ids, kept, token_ids, drafted, accepted, finish, logprobs):
        base = self.num_rows
        self.parts.append((req_ids, kept, token_ids, drafted, accepted))
        self.finish.update({base + i: f for i, f in finish.items()})
        self.logprobs.update({base + i: lp for i, lp in logprobs.items()})
        self.num_rows += len(req_ids)

    def add_row(self, req_id: int, token_ids: list[int], finish, logprobs) -> None:
        one = np.ones(1, dtype=np.int64)
        self.add_columns(
            one * req_id,
            one * len(token_ids),
            np.asarray(token_ids, dtype=np.int64),
            one * 0,
            one * 0,
            {0: finish} if finish is not None else {},
            {0: logprobs} if logprobs is not None else {},
        )

    def build(self) -> RoundDeltas:
        if not self.parts:
            return RoundDeltas.empty()
        columns = [np.concatenate(c) if len(self.parts) > 1 else c[0] for c in zip(*self.parts)]
        return RoundDeltas.build(*columns, self.finish, self.logprobs)


class QueueFullError(RuntimeError):
    """The backlog is at --max-queue; the server answers 503."""


def _f(default, help_: str):
    return field(default=default, metadata={"help": help_})


# A prompt's rest of at most 1/PREFILL_TAIL_DIV of the prefill budget is taken with its chunk
# rather than left to a round of its own: every round with a chunk runs eagerly, bound by
# launching its kernels, and on the H200 (2026-11-30 record) rounds with a prompt's last 9-331
# rows took 22-45 ms where their decoding requests could have run a graphed 5-8 ms round. A round
# then holds up to max_chunk_rows(budget) prompt rows.
PREFILL_TAIL_DIV = 8


def prefill_tail_rows(max_prefill_tokens: int) -> int:
    """A prompt's rest taken with its chunk past a prefill budget, at most."""
    return max_prefill_tokens // PREFILL_TAIL_DIV


def max_chunk_rows(max_prefill_tokens: int) -> int:
    """The most prompt rows one round takes under a prefill budget (its short-rest allowance)."""
    return max_prefill_tokens + prefill_tail_rows(max_prefill_tokens)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_concurrency: int = _f(64, "live slot capacity")
    max_queue: int = _f(1024, "waiting requests beyond which add_request raises QueueFullError")
    spec_mode: str = _f("adaptive", "adaptive | spec | ar")
    spec_depth: int = _f(8, "rows per speculating request at most (drafts + 1)")
    block_size: int = _f(16, "tokens per KV block")
    max_prefill_tokens: int = _f(
        2048,
        "prefill rows per round (chunked prefill budget; a prompt's rest of 1/8 of it goes along)",
    )
    max_model_len: int = _f(0, "prompt + max_tokens limit; 0: only the KV capacity limits")
    has_drafter: bool = _f(True, "a drafter is loaded; without one no round speculates")
    drafter_follows_prefill: str = _f(
        "off",
        "whether the drafter computes prefill chunks alongside the target (a draft model; "
        "otherwise it catches up on the whole context at a request's first SPEC round): off, "
        "on, or auto (prompts whose following the policy's speculation on the live batch, "
        "every request decoding with its drafter caught up, would pay back)",
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
        if self.drafter_follows_prefill not in FOLLOW_MODES:
            raise ValueError(
                f"drafter_follows_prefill must be one of {', '.join(FOLLOW_MODES)}, got "
                f"{self.drafter_follows_prefill!r}"
            )

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
        self.cost_model.drafter_prefill = False  # per round: whether its chunks are followed
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
        # plans launched and not yet updated, oldest first (two when one was advanced), each
        # with the cost model's raw prediction, run ahead and alone (they differ for AR rounds),
        # and the accepted drafts the estimators expected of it
        self._inflight: list[tuple[RoundPlan, float, float, float]] = []
        # the launched AR round whose one token per request is already counted (advance())
        self._advanced: RoundPlan | None = None
        self._advanced_live = np.zeros(0, dtype=bool)  # [n] its rows that advance() counted
        # Per-slot state of decoding requests (the source of truth while a request decodes).
        num_slots = config.max_concurrency
        self._slot_reqs: list[Request | None] = [None] * num_slots
        self._slot_req_id = np.full(num_slots, -1, dtype=np.int64)
        self._slot_decoding = np.zeros(num_slots, dtype=bool)
        self._num_computed = np.zeros(num_slots, dtype=np.int64)
        self._drafter_lag = np.zeros(num_slots, dtype=np.int64)
        self._last_follow = False  # the last auto answer (_follows_prefill)
        self._follow_asked = (-FOLLOW_RECHECK_ROUNDS, -1)  # (round, live requests) of it
        self._last_mode = np.zeros(num_slots, dtype=np.int64)
        self._mode_since = np.zeros(num_slots, dtype=np.int64)
        self._remaining = np.zeros(num_slots, dtype=np.int64)  # max_tokens - outputs
        self._spec_code = np.zeros(num_slots, dtype=np.int64)
        self._num_blocks = np.zeros(num_slots, dtype=np.int64)  # KV blocks the slot's request holds
        self._dec_slots = np.zeros(0, dtype=np.int64)  # decoding slots in admission order
        self._dec_dirty = False
        self._stop_ids: set[int] = set()  # every EOS / stop token id of any request
        self._stop_ids_arr = np.zeros(0, dtype=np.int64)
        self._setups: list[SeqSetup] = []  # setups of the plan being made
        self._round_id = 0
        self._admit_seq = 0
        self._cohort_changed = True
        self._last_raw_ms = 0.0
        self._last_extra_tokens = 0.0
        self._last_reason = ""
        self._last_probe = False  # whether the last decision was a probe
        # (slots, req ids, drafts, reason, expected extra tokens, drafts within the static
        # caps, a probe) decided ahead for the next round (prepare_decision)
        self._prepared: tuple | None = None
        # Rounds whose acceptance outcomes the estimator has not taken in yet, oldest first:
        # None (decay only) or (slots, drafted, accepted, calibration weight). update() only
        # records them; they are applied before any decision that reads the estimator
        # (prepare_decision in the engine's overlap window, or a fresh decision in plan()), off
        # the host's critical path.
        self._pending_obs: list[tuple | None] = []
        self._last_plan: RoundPlan | None = None
        self._last_measured_ms = 0.0
        self.rate_tracker = RateTracker()
        self.yield_tracker = YieldTracker()
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
        new_stop_ids = set(spec.eos_token_ids) | set(spec.stop_token_ids)
        if not new_stop_ids <= self._stop_ids:
            self._stop_ids |= new_stop_ids
            self._stop_ids_arr = np.array(sorted(self._stop_ids), dtype=np.int64)
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
        self._end_decoding(req)
        self._to_release.append(req)

    def stop(self, req_id: int, num_output_tokens: int, stop_reason: int | str | None) -> None:
        """Ends a request at a stop found after update() (the engine matches stop strings while
        the next round runs): it keeps its first `num_output_tokens` outputs, the tokens of a
        round still in flight are dropped, and its slot and blocks go back in the next plan."""
        req = self._requests.get(req_id)
        if req is None or req.state == ReqState.ABORTED:
            return
        del req.output_token_ids[num_output_tokens:]
        was_done = req.is_done
        req.state = ReqState.FINISHED
        req.finish_reason = "stop"
        req.stop_reason = stop_reason
        if was_done:
            return  # finished in the same round (EOS, length): already on its way out
        if req.slot < 0:  # preempted and waiting: it never runs again
            self.admission.remove(req)
            self.kv.free(req_id)
            del self._requests[req_id]
            return
        self._end_decoding(req)
        self._to_release.append(req)

    def acceptance_knowledge(self) -> AcceptanceKnowledge:
        """What the estimator learned of the drafter on this traffic (prior, evidence,
        calibration), for a scheduler that replaces this one (`adopt_acceptance`)."""
        return self.estimator.knowledge()

    def adopt_acceptance(self, known: AcceptanceKnowledge) -> None:
        """Starts the estimator from what an earlier scheduler of the same drafter learned
        instead of the configured prior. Only before the first request: beliefs of live
        requests are not rewritten (RuntimeError otherwise)."""
        if self._requests:
            raise RuntimeError("adopt_acceptance on a scheduler that holds requests")
        self.estimator.adopt(known)

    def has_work(self) -> bool:
        return bool(self._live or self.admission.num_waiting or self._to_release)

    # ---------------------------------------------------------------- planning

    def _release(self, released: list[int]) -> None:
        for req in self._to_release:
            if req.slot < 0:
                continue
            self._free_slot_state(req)
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
        self._free_slot_state(req)
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
            self._slot_reqs[req.slot] = req
            self._slot_req_id[req.slot] = req.req_id
            req.state = ReqState.PREFILLING
            req.num_computed = 0
            req.num_prefill_target = req.context_len
            req.admit_seq = self._admit_seq
            self._admit_seq += 1
            req.admit_time = now
            req.last_mode = Mode.PREFILL  # no decode decision yet
            req.mode_since_round = self._round_id
            req.drafter_lag = 0
            self._flush_observations()  # a slot's last outcomes must not reach its new request
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
            self._num_blocks[req.slot] += need
        return True

    # ---------------------------------------------------------------- per-slot state

    def _end_decoding(self, req: Request) -> None:
        """The request no longer decodes: later plans skip it, results in flight are dropped."""
        if req.slot >= 0 and self._slot_decoding[req.slot]:
            self._slot_decoding[req.slot] = False
            self._dec_dirty = True

    def _free_slot_state(self, req: Request) -> None:
        """Returns the request's KV blocks and clears its slot's row (the slot index itself is
        handed back by the caller)."""
        self.kv.free(req.req_id)
        self._end_decoding(req)
        slot = req.slot
        self._slot_reqs[slot] = None
        self._slot_req_id[slot] = -1
        self._num_blocks[slot] = 0

    def _start_decoding(self, req: Request) -> None:
        """Prefill done: the request's decode state moves into the per-slot arrays."""
        slot = req.slot
        self._num_computed[slot] = req.num_computed
        self._drafter_lag[slot] = req.drafter_lag
        self._last_mode[slot] = req.last_mode
        self._mode_since[slot] = req.mode_since_round
        self._remaining[slot] = req.num_remaining
        self._spec_code[slot] = _SPECULATION_CODE[req.spec.speculation]
        self._slot_decoding[slot] = True
        self._dec_dirty = True

    def _decoding_slots(self) -> np.ndarray:
        """[n] slots of the decoding requests in admission order (rebuilt only after a change
        of the decoding set)."""
        if self._dec_dirty:
            self._dec_slots = np.array(
                [r.slot for r in self._live if r.state == ReqState.DECODING and r.slot >= 0],
                dtype=np.int64,
            )
            self._dec_dirty = False
        return self._dec_slots

    def _live_decoding_slots(self) -> np.ndarray:
        """The decoding slots that may get a row: while an advanced round runs (its tokens
        counted), not the requests it takes to max_tokens."""
        slots = self._decoding_slots()
        if self._advanced is not None and len(slots):
            out_of_tokens = self._remaining[slots] <= 0
            if out_of_tokens.any():
                return slots[~out_of_tokens]
        return slots

    def _allocate_one_each(self, slots: np.ndarray) -> list[int]:
        new_ids = self.kv.allocate_one_each(self._slot_req_id[slots].tolist())
        self._num_blocks[slots] += 1
        return new_ids

    def _allocate_many(self, slots: np.ndarray, counts: np.ndarray) -> list[int]:
        new_ids = self.kv.allocate_many(self._slot_req_id[slots].tolist(), counts.tolist())
        self._num_blocks[slots] += counts
        return new_ids

    def _truncate(self, req: Request, num_tokens: int) -> None:
        self.kv.truncate_to(req.req_id, num_tokens)
        self._num_blocks[req.slot] = self.kv.num_blocks_of(req.req_id)

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
        prefilling = (
            [r for r in self._live if r.state == ReqState.PREFILLING]
            if len(self._live) > len(self._dec_slots) or self._dec_dirty
            else []
        )
        tail = prefill_tail_rows(cfg.max_prefill_tokens)
        for req in prefilling:
            if budget <= 0:
                break
            if req.slot < 0:
                continue  # preempted to make room for an older request
            rest = req.num_prefill_target - req.num_computed
            chunk = min(rest, budget)
            if rest - chunk <= tail:  # (a short rest goes with it: see PREFILL_TAIL_DIV)
                chunk = rest
            if not self._reserve(req, req.num_computed + chunk, released):
                break
            prefills.append((req, chunk))
            budget -= chunk

        # Decode rows: every decoding request gets at least its AR row, oldest first.
        slots = self._live_decoding_slots()
        # (indices, ids) of the AR rows' new blocks when allocated in one batch
        self._ar_blocks: tuple[np.ndarray, list[int]] | None = (np.zeros(0, np.int64), [])
        bs = self.kv.block_size
        num_preempted = self._num_preemptions
        if len(slots):
            # the block of the AR row's position is usually held already
            lacking = np.flatnonzero(self._num_computed[slots] >= self._num_blocks[slots] * bs)
            if len(lacking) and len(lacking) <= self.kv.num_free:
                ar_ids = self._allocate_one_each(slots[lacking])
                self._ar_blocks = (lacking, ar_ids)
            elif len(lacking):
                self._ar_blocks = None  # the per-request path: new ids gathered from the tables
                keep = np.ones(len(slots), dtype=bool)
                for i in lacking.tolist():  # oldest first; may preempt younger requests
                    req = self._slot_reqs[slots[i]]
                    gone = req is None or req.slot < 0 or not self._slot_decoding[req.slot]
                    end = 0 if gone else int(self._num_computed[req.slot]) + 1
                    if gone or not self._reserve(req, end, released):
                        keep[i] = False
                slots = slots[keep]
        if self._num_preemptions != num_preempted:  # some were preempted to make room
            self._ar_blocks = None
            slots = slots[self._slot_decoding[slots]]
            prefills = [(r, c) for r, c in prefills if r.slot >= 0]

        follow = bool(prefills) and self._follows_prefill(prefills)
        self.cost_model.drafter_prefill = follow  # the round's price includes the draft forward
        num_draft = (
            self._decide(slots, prefills)
            if self._advanced is None
            else self._decide_behind(slots, prefills)
        )
        decode, route, total_rows, kv_tokens, d_max, lag = self._build_decode(slots, num_draft)
        prefill_plans = self._build_prefills(prefills)
        route += "P" * len(prefill_plans)
        num_prefill_rows = sum(c for _, c in prefills)
        total_rows += num_prefill_rows
        kv_tokens += sum(q.num_computed + q.num_new for q in prefill_plans)
        num_spec = int(np.count_nonzero(decode.num_draft))
        predicted_ms = 0.0
        self._last_raw_ms = 0.0
        if total_rows:
            cm = self.cost_model
            self._last_raw_ms = cm.raw_ms_scalar(
                total_rows,
                kv_tokens,
                d_max,
                num_spec,
                lag,
                num_prefill_rows,
                num_draft_rows=int(decode.num_draft.sum()),
            )
            predicted_ms = cm.correct_ms_scalar(
                self._last_raw_ms, total_rows, d_max > 0, num_prefill_rows > 0
            )
        predicted_tokens = float(len(slots)) + float(
            sum(1 for r, c in prefills if r.num_computed + c == r.num_prefill_target)
        )
        plan = RoundPlan(
            round_id=round_id,
            setup=tuple(setups),
            release=tuple(released),
            decode=decode,
            prefills=prefill_plans,
            follow_prefill=follow,
            num_rows=total_rows,
            row_bucket=self._row_bucket(total_rows, prefills),
            num_kv_tokens=kv_tokens,
            spec_depth=d_max + 1,
            drafter_lag_rows=lag if d_max else 0,
            predicted_ms=predicted_ms,
            predicted_tokens=predicted_tokens + self._last_extra_tokens,
            route=route,
            reason=self._last_reason,
            probe=self._last_probe,
        )
        self._last_plan = plan
        raw_alone = self._last_raw_ms
        if total_rows and d_max == 0 and not num_prefill_rows:
            raw_alone /= self.cost_model.profile.ahead_ratio_scalar(total_rows)
        self._inflight.append((plan, self._last_raw_ms, raw_alone, self._last_extra_tokens))
        self._cohort_changed = False
        # Slots released by this plan become reusable from the next plan on.
        self._free_slots.extend(released)
        return plan

    def _row_bucket(self, num_rows: int, prefills) -> int:
        """Graph bucket of a decode-only round; prefill rounds and rows past the largest bucket
        run eagerly (0)."""
        profile = self.cost_model.profile
        buckets = profile.row_buckets
        if prefills or num_rows == 0 or num_rows > buckets[-1]:
            return 0
        return int(buckets[profile.bucket_index_list[num_rows]])  # (a scalar table lookup)

    def _decide(self, slots: np.ndarray, prefills) -> np.ndarray:
        n = len(slots)
        self._last_extra_tokens = 0.0
        self._round_ar_rate = 0.0
        prepared, self._prepared = self._prepared, None
        self._last_probe = False
        if n == 0 or self.config.max_drafts == 0:
            self._last_reason = "no decoding request" if n == 0 else "no speculation"
            return np.zeros(n, dtype=np.int64)
        cfg = self.config
        if (
            prepared is not None
            and not prefills
            and not self._cohort_changed
            # the decoding-slot array is rebuilt (a new object) whenever the decoding set
            # changes, so the same object means the same requests
            and (
                prepared[0] is slots
                or (
                    np.array_equal(prepared[0], slots)
                    and np.array_equal(prepared[1], self._slot_req_id[slots])
                )
            )
        ):
            # Decided ahead (prepare_decision) for exactly these requests: only what changed
            # since is checked (a request with fewer tokens left cannot use as many drafts).
            remaining = self._remaining[slots]
            ahead = prepared[2]
            if prepared[5] and (remaining > ahead).all():
                # within the static caps and every request has a token left past its drafts:
                # the caps below would change nothing
                num_draft = ahead
                extra = prepared[4]
            else:
                caps = np.where(
                    self._spec_code[slots] > 0, np.minimum(remaining - 1, cfg.max_drafts), 0
                )
                num_draft = np.minimum(ahead, np.maximum(caps, 0))
                extra = prepared[4] if np.array_equal(num_draft, ahead) else None
            self._last_reason = prepared[3] + " (ahead)"
            self._last_probe = prepared[6]
            ar_ms = self.cost_model.predict_ms_scalar(n, int(self._num_computed[slots].sum()) + n)
        else:
            extra = None
            self._flush_observations()
            view, ar_ms = self._policy_view(slots, prefills, self._round_id)
            decision = self.policy.decide(view, self.estimator, self.cost_model)
            self._last_reason = decision.reason
            self._last_probe = decision.probe
            num_draft = np.asarray(decision.num_draft, dtype=np.int64)
        # Only decode-only rounds feed the rate bar (see RateTracker): with a prefill chunk in
        # the round, drafts ride on an expensive eager forward and the uplift over AR is far
        # above what decode rounds can reach.
        self._round_ar_rate = 0.0 if prefills else n / ar_ms
        if extra is not None:
            self._last_extra_tokens = extra
        elif num_draft.any():
            self._last_extra_tokens = self._expected_extra_tokens(slots, num_draft)
        return num_draft

    def _decide_behind(self, slots: np.ndarray, prefills) -> np.ndarray:
        """The decision of a round planned while the advanced round runs: AR for everyone (a
        speculative row needs its request's last token, still on the device, for drafting)."""
        self._prepared = None
        self._last_extra_tokens = 0.0
        self._last_reason = "AR, planned while the previous round runs"
        self._last_probe = False
        n = len(slots)
        self._round_ar_rate = 0.0
        if n and not prefills:
            kv_tokens = int(self._num_computed[slots].sum()) + n
            self._round_ar_rate = n / self.cost_model.predict_ms_scalar(n, kv_tokens)
        return np.zeros(n, dtype=np.int64)

    def may_plan_ahead(self) -> bool:
        """Whether the next round can be planned while the advanced one runs: the policy's
        decision made ahead (prepare_decision) has no request speculating, or the server never
        speculates."""
        if self.config.max_drafts == 0 or self.config.spec_mode == "ar":
            return True
        prepared = self._prepared
        return prepared is not None and not prepared[2].any()

    def advance(self, plan: RoundPlan) -> None:
        """Counts the launched AR-only decode round `plan` as done, one token per request, so
        the next round can be planned (and launched) while it runs. Its update() later takes
        the count back and applies what really happened (stops, aborts)."""
        if self._advanced is not None or not self._inflight or self._inflight[-1][0] is not plan:
            raise RuntimeError(f"round {plan.round_id} is not the last round launched")
        dec = plan.decode
        if plan.prefills or not len(dec) or dec.num_draft.any():
            raise ValueError(f"round {plan.round_id} is not an AR-only decode round")
        slots = dec.slots
        live = self._slot_decoding[slots] & (self._slot_req_id[slots] == dec.req_ids)
        step = live.astype(np.int64)
        self._num_computed[slots] += step
        self._remaining[slots] -= step
        self._drafter_lag[slots] += step
        self._advanced = plan
        self._advanced_live = live

    def _expected_extra_tokens(self, slots: np.ndarray, num_draft: np.ndarray) -> float:
        """Accepted drafts the estimators expect of these depths, whatever policy chose them."""
        d = self.config.max_drafts
        survival = self.estimator.survival(slots)[:, :d]  # [n, D]
        taken = np.arange(d)[None, :] < num_draft[:, None]
        return float((survival * taken).sum())

    def _follows_prefill(self, prefills) -> bool:
        """Whether the drafter follows this round's prefill chunks (see drafter_follows_prefill).
        auto: where the speculation the policy would choose on the live batch, every request
        decoding with its drafter caught up, saves more than following the starting prompts
        costs (`AdaptivePolicy.following_pays`; a fixed policy: whether it speculates). Asked when
        a prompt starts; chunks that continue prompts keep the last answer (a prompt is
        followed only as far as its chunks continue the draft KV, so switching midway wastes
        what was followed), and so do prompts starting soon after it in a batch of the same
        size (FOLLOW_RECHECK_ROUNDS). The whole live batch, not the requests decoding now:
        while slots fill, the few that decode are held to the rate of all live requests
        (decode_basis) and never speculate, yet the prompts starting then are the batch that
        decodes next; asked of the decoding ones only, auto followed none of the first wave
        and the code-like cohort at C = 16 stayed in AR (0.91x all-spec full-live in the
        simulator)."""
        mode = self.config.drafter_follows_prefill
        if mode == "off" or self.config.max_drafts == 0:
            return False
        if mode == "on":
            return True
        if not any(r.num_computed == 0 for r, _ in prefills):
            return self._last_follow
        asked_round, asked_live = self._follow_asked
        same_size = abs(len(self._live) - asked_live) <= asked_live // FOLLOW_SIZE_TOLERANCE
        if self._round_id - asked_round < FOLLOW_RECHECK_ROUNDS and same_size:
            return self._last_follow  # (see FOLLOW_RECHECK_ROUNDS)
        self._follow_asked = (self._round_id, len(self._live))
        if (ask := getattr(self.policy, "following_pays", None)) is None:
            follow = self.config.spec_mode == "spec"
        else:
            starting = [r for r, _ in prefills if r.num_computed == 0]
            profile = self.cost_model.profile
            follow_ms = sum(profile.follow_ms(r.num_prefill_target) for r in starting)
            num_tokens = float(sum(r.num_remaining for r in starting))
            view = self._steady_view()
            follow = bool(ask(view, self.estimator, self.cost_model, follow_ms, num_tokens))
        self._last_follow = follow
        return follow

    def _steady_view(self) -> DecodeView:
        """The policy's view of the live batch as it will decode: every live request decoding,
        those still in prefill with their whole prompt computed, at the global prior (their
        estimators start there), out of any dwell, their drafters caught up."""
        live = [r for r in self._live if r.slot >= 0]
        slots = np.array([r.slot for r in live], dtype=np.int64)
        view, _ = self._policy_view(slots, (), self._round_id)
        pre = np.flatnonzero(~self._slot_decoding[slots])  # positions of prefilling requests
        if not len(pre):
            return view
        reqs = [live[i] for i in pre]
        code = np.array([_SPECULATION_CODE[r.spec.speculation] for r in reqs], dtype=np.int64)

        def put(column: np.ndarray, values) -> np.ndarray:
            out = column.copy()
            out[pre] = values
            return out

        n = len(slots)
        decoding = slots[self._slot_decoding[slots]]
        kv = int(self._num_computed[decoding].sum()) + sum(r.num_prefill_target for r in reqs) + n
        ar_ms = self.cost_model.predict_ms_scalar(n, kv)
        return replace(
            view,
            num_remaining=put(view.num_remaining, [r.num_remaining for r in reqs]),
            drafter_lag=put(view.drafter_lag, 0),
            may_spec=put(view.may_spec, code > 0),
            must_spec=put(view.must_spec, code == 2),
            was_spec=put(view.was_spec, False),
            in_dwell=put(view.in_dwell, False),
            weights=np.ones(n),
            base_kv_tokens=kv,
            base_tokens=float(n),
            draining=False,
            rate_bar=self.rate_tracker.uplift * n / ar_ms,
        )

    def _policy_view(self, slots: np.ndarray, prefills, round_id: int):
        """The policy's view of a round that decodes `slots` next to `prefills` (chunks), and
        the predicted time of its all-AR alternative."""
        n = len(slots)
        cfg = self.config
        remaining = self._remaining[slots]
        last_mode = self._last_mode[slots]
        spec_code = self._spec_code[slots]
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
        base_kv_tokens = (
            int(self._num_computed[slots].sum()) + n + sum(r.num_computed + c for r, c in prefills)
        )
        base_tokens = float(weights.sum()) + prefill_done
        ar_ms = self.cost_model.predict_ms_scalar(
            base_rows, base_kv_tokens, 0, 0, 0, num_prefill_rows
        )
        view = DecodeView(
            req_ids=self._slot_req_id[slots],
            slots=slots,
            num_remaining=remaining,
            drafter_lag=self._drafter_lag[slots],
            may_spec=spec_code > 0,
            must_spec=spec_code == 2,
            was_spec=last_mode == Mode.SPEC,
            # a request's first decode round has no mode to hold on to yet
            in_dwell=(round_id - self._mode_since[slots] < cfg.min_dwell_rounds)
            & (last_mode != Mode.PREFILL),
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
            yield_factor=self.yield_tracker.factor,
        )
        return view, ar_ms

    def _flush_observations(self) -> None:
        """Applies the recorded rounds' outcomes to the acceptance estimator, in order."""
        if not self._pending_obs:
            return
        est = self.estimator
        for obs in self._pending_obs:
            est.decay()
            if obs is not None:
                est.observe(*obs)
        self._pending_obs.clear()

    def prepare_decision(self) -> None:
        """Makes the next round's speculation decision ahead of its plan(): the engine calls
        this while the device runs the current round, so the policy's search leaves the host
        time between rounds. It sees the request state and acceptance estimates of one round
        earlier (the running round's outcome is not known yet); plan() uses it only when the
        next round decodes exactly the same requests with no prefill chunk and no arrival or
        departure in between, and decides afresh otherwise."""
        self._prepared = None
        self._flush_observations()
        slots = self._live_decoding_slots()
        if len(slots) == 0 or self.config.max_drafts == 0:
            return
        view, _ = self._policy_view(slots, (), self._round_id + 1)
        decision = self.policy.decide(view, self.estimator, self.cost_model)
        # a copy: plan() may hand this very array on (read-only) as the round's depths
        num_draft = np.array(decision.num_draft, dtype=np.int64)
        extra = self._expected_extra_tokens(slots, num_draft) if num_draft.any() else 0.0
        # Every depth within the caps that cannot change before the plan (drafts allowed,
        # max_drafts): plan() then only checks the tokens each request has left.
        within_caps = bool(
            (
                (num_draft >= 0)
                & (num_draft <= self.config.max_drafts)
                & (view.may_spec | (num_draft == 0))
            ).all()
        )
        # the slot array itself is kept (never mutated: replaced when the set changes)
        self._prepared = (
            slots,
            view.req_ids.copy(),
            num_draft,
            decision.reason,
            extra,
            within_caps,
            decision.probe,
        )

    def _build_decode(self, slots: np.ndarray, num_draft: np.ndarray):
        """Allocates the drafts' KV blocks and builds the decode columns of the plan."""
        n = len(slots)
        if n == 0:
            return DecodeRows.empty(), "", 0, 0, 0, 0
        kv = self.kv
        bs = kv.block_size
        num_computed = self._num_computed[slots]  # [n]
        d = num_draft
        d_max = int(d.max())
        spec = d > 0
        draft_blocks: tuple[np.ndarray, np.ndarray, list[int]] | None = None
        if d_max > 0:
            # Every request needs at most ceil(d / bs) + 1 new blocks; when the pool holds that
            # for everyone, no request can run short (the common case: one batched allocation).
            if n * (-(-d_max // bs) + 1) <= kv.num_free:
                # blocks to cover rows up to position num_computed + d: ceil((nc + d + 1) / bs)
                need = (num_computed + d) // bs + 1 - self._num_blocks[slots]
                take = np.flatnonzero((need > 0) & spec)
                if len(take):
                    need = need[take]  # [len(take)]
                    draft_blocks = (take, need, self._allocate_many(slots[take], need))
            else:
                self._ar_blocks = None
                d = d.copy()
                for i in np.flatnonzero(d).tolist():
                    slot = int(slots[i])
                    held = int(self._num_blocks[slot])
                    di = int(d[i])
                    need = -(-(int(num_computed[i]) + 1 + di) // bs) - held
                    # drafts whose KV does not fit are dropped, never an error
                    while di > 0 and need > kv.num_free:
                        di -= 1
                        need = -(-(int(num_computed[i]) + 1 + di) // bs) - held
                    if need > 0 and di > 0:
                        self._allocate_many(slots[i : i + 1], np.array([need], dtype=np.int64))
                    d[i] = di
                d_max = int(d.max())
                spec = d > 0
        mode = spec + int(Mode.AR)  # [n] AR or SPEC (Mode.SPEC == Mode.AR + 1)
        last_mode = self._last_mode[slots]
        changed = mode != last_mode
        if changed.any():
            # the first decision after the prefill is not a switch
            self._num_switches += int(np.count_nonzero(changed & (last_mode != Mode.PREFILL)))
            moved = slots[changed]
            self._last_mode[moved] = mode[changed]
            self._mode_since[moved] = self._round_id
        # The table is exactly ceil(num_computed / bs) long after update(); every block past
        # that was allocated for this round (AR row above, drafts here).
        block_offset = (num_computed + (bs - 1)) // bs  # ceil(num_computed / bs)
        block_counts = np.maximum(self._num_blocks[slots] - block_offset, 0)
        req_ids = self._slot_req_id[slots]
        new_ids = self._new_block_ids(req_ids, block_offset, block_counts, draft_blocks)
        decode = DecodeRows.build(
            req_ids, slots, num_computed, d, block_offset, block_counts, new_ids
        )
        route = spec.tobytes().translate(_ROUTE_LETTERS).decode()
        total_rows = n + int(d.sum())
        kv_tokens = int(num_computed.sum()) + total_rows
        lag = int(self._drafter_lag[slots] @ spec)  # drafter lag of the speculating requests
        return decode, route, total_rows, kv_tokens, d_max, lag

    def _new_block_ids(self, req_ids, block_offset, block_counts, draft_blocks):
        """Flat new block ids of the decode rows in request order: from this round's batched
        allocations (AR row block first, then the drafts') when they account for every new
        block, else gathered from the pool's tables."""
        ar = self._ar_blocks
        if ar is not None:
            ar_idx, ar_ids = ar
            num_drafts = len(draft_blocks[2]) if draft_blocks is not None else 0
            # Every request already held the blocks of its committed tokens, so it has at least
            # as many new blocks as this round allocated for it: equal totals, equal counts.
            if len(ar_ids) + num_drafts == int(block_counts.sum()):
                if not num_drafts:
                    return ar_ids  # already in request order
                take, need, draft_ids = draft_blocks
                # request i's AR block (key 2i) goes before its drafts' blocks (key 2i + 1)
                draft_keys = take * 2 + 1  # [len(take)]
                if num_drafts != len(take):
                    draft_keys = np.repeat(draft_keys, need)  # [num_drafts]
                order = np.argsort(np.concatenate((ar_idx * 2, draft_keys)), kind="stable")
                return np.array(ar_ids + draft_ids, dtype=np.int64)[order]
        new_ids: list[int] = []
        tables = self.kv.tables
        for i in np.flatnonzero(block_counts).tolist():
            new_ids += tables[int(req_ids[i])][int(block_offset[i]) :]
        return new_ids

    def _build_prefills(self, prefills) -> tuple[ReqPlan, ...]:
        bs = self.kv.block_size
        plans = []
        for req, chunk in prefills:
            first_new = num_blocks_for(req.num_computed, bs)
            plans.append(
                ReqPlan(
                    req_id=req.req_id,
                    slot=req.slot,
                    mode=Mode.PREFILL,
                    num_computed=req.num_computed,
                    num_new=chunk,
                    block_offset=first_new,
                    new_block_ids=self.kv.blocks_from(req.req_id, first_new),
                    sample=req.num_computed + chunk == req.num_prefill_target,
                )
            )
        return tuple(plans)

    # ---------------------------------------------------------------- results

    def update(self, result: RoundResult, now: float) -> RoundDeltas:
        measured_ms = result.timings.total_ms
        self._last_measured_ms = measured_ms
        while self._inflight and self._inflight[0][0].round_id < result.round_id:
            self._inflight.pop(0)  # planned with nothing to run: never launched
        plan, raw_ms, raw_alone, expected = self._inflight[0] if self._inflight else (None, 0, 0, 0)
        if plan is not None and plan.round_id == result.round_id:
            self._inflight.pop(0)
        else:
            plan = None
        # The round's period: a speculating round's also holds the engine's host time around
        # it, which the executor's measurement leaves out and its price includes.
        period_ms = measured_ms
        if measured_ms > 0:
            self.admission.charge(measured_ms / 1e3)
            if plan is not None and raw_ms > 0:
                # an AR round that did not overlap the next one is compared with its price
                # alone: the correction stays about the model, not about the overlap
                raw = raw_ms if result.overlapped else raw_alone
                if plan.spec_depth > 1:  # the engine's host time is not in the executor's
                    host_ms = self.cost_model.profile.round_spec_host_ms(
                        plan.num_rows,
                        sum(q.num_new for q in plan.prefills),
                        int(np.count_nonzero(plan.decode.num_draft)),
                        plan.spec_depth - 1,
                        int(plan.decode.num_draft.sum()),
                    )
                    raw -= host_ms
                    period_ms += host_ms
                self.cost_model.observe(
                    plan.num_rows, plan.spec_depth > 1, raw, measured_ms, bool(plan.prefills)
                )
        self._pending_obs.append(None)  # this round decays every belief (applied later)
        out = result.out
        if plan is None:
            return RoundDeltas.empty()  # not the oldest round in flight: nothing to apply
        if plan is self._advanced:
            # take back advance()'s count for the requests it counted and that still decode:
            # the outcome below applies the real one
            self._advanced = None
            slots = plan.decode.slots
            step = (
                self._advanced_live
                & self._slot_decoding[slots]
                & (self._slot_req_id[slots] == plan.decode.req_ids)
            ).astype(np.int64)
            self._num_computed[slots] -= step
            self._remaining[slots] += step
            self._drafter_lag[slots] -= step
        if len(out) != plan.num_reqs:
            raise ValueError(
                f"round {result.round_id}: {len(out)} result rows for {plan.num_reqs} requests"
            )
        dec = plan.decode
        n = len(dec)
        if n and not np.array_equal(out.req_ids[:n], dec.req_ids):
            raise ValueError(f"round {result.round_id}: result rows are not in plan order")
        starts = out.token_starts
        tokens = out.token_ids.tolist()
        cols = _DeltaColumns()
        if n:
            self._apply_decode(dec, out, tokens, cols, plan.probe)
            d = dec.num_draft
            if d.any():
                accepted = float(np.minimum(out.num_accepted[:n], d).sum())
                self.yield_tracker.observe(expected, accepted)
            else:
                self.yield_tracker.relax()
        for j, q in enumerate(plan.prefills):
            self._apply_prefill(
                q, out, n + j, tokens[starts[n + j] : starts[n + j + 1]], cols, plan.follow_prefill
            )
        if self._round_ar_rate > 0:
            # (in the currency of the plans it is compared with: priced periods)
            self.rate_tracker.observe(int(starts[-1]), period_ms, self._round_ar_rate)
        return cols.build()

    def _apply_decode(
        self, dec: DecodeRows, out, tokens: list[int], cols, probe: bool = False
    ) -> None:
        """The decode rows of a round: counters, stops, outputs and KV as array work; only
        requests whose run holds a stop candidate go through the per-token loop."""
        n = len(dec)
        slots = dec.slots
        d = dec.num_draft
        starts = out.token_starts[: n + 1]
        emitted = np.diff(starts)  # [n]
        # aborted, finished by a stop string or preempted meanwhile: tokens are dropped
        live = self._slot_decoding[slots] & (self._slot_req_id[slots] == dec.req_ids)
        accepted = np.minimum(out.num_accepted[:n], d)
        spec = d > 0
        new_computed = self._num_computed[slots] + 1 + accepted
        self._num_computed[slots] = np.where(live, new_computed, self._num_computed[slots])
        lag = self._drafter_lag[slots]
        # a fully accepted chain leaves its last draft without draft KV: one row to catch up
        caught = (spec & (accepted == d)).astype(np.int64)
        self._drafter_lag[slots] = np.where(live, np.where(spec, caught, lag + 1), lag)
        observed = live & spec
        if observed.any():
            weight = PROBE_CALIB_WEIGHT if probe else 1.0
            self._pending_obs[-1] = (slots[observed], d[observed], accepted[observed], weight)
            self._num_drafted += int(d[observed].sum())
            self._num_accepted += int(accepted[observed].sum())
        # Stops: max_tokens reached inside the run, a stop/EOS id among the tokens, or a stop
        # checker (then every request is checked).
        remaining = self._remaining[slots]
        candidate = live & (emitted >= remaining)
        if self.stop_checker is not None:
            candidate = live.copy()
        elif len(self._stop_ids_arr) and starts[-1]:
            hits = np.flatnonzero(np.isin(out.token_ids[: starts[-1]], self._stop_ids_arr))
            if len(hits):
                rows = np.searchsorted(starts, hits, side="right") - 1
                candidate[rows] |= live[rows]
        kept = np.where(live, emitted, 0)
        finish: dict[int, tuple[str, int | str | None]] = {}
        slot_reqs = self._slot_reqs
        starts_l = starts.tolist()
        for i in np.flatnonzero(candidate).tolist():
            req = slot_reqs[slots[i]]
            run = tokens[starts_l[i] : starts_l[i + 1]]
            keep, reason, stop_reason = self._stop_in_run(req, run)
            kept[i] = keep
            if reason is not None:
                finish[i] = (reason, stop_reason)
        kept_l = kept.tolist()
        for i in np.flatnonzero(live).tolist():
            a = starts_l[i]
            slot_reqs[slots[i]].output_token_ids += tokens[a : a + kept_l[i]]
        self._remaining[slots] -= kept
        for i, (reason, stop_reason) in finish.items():
            req = slot_reqs[slots[i]]
            req.state = ReqState.FINISHED
            req.finish_reason = reason
            req.stop_reason = stop_reason
            self._end_decoding(req)
            self._to_release.append(req)
        # KV past the committed end (rejected drafts) goes back, unless the request finished
        bs = self.kv.block_size
        # (AR rows hold exactly their committed blocks already, and a round planned ahead may
        # hold the block of its next position)
        over = self._slot_decoding[slots] & live & spec
        over &= self._num_blocks[slots] > -(-new_computed // bs)
        for i in np.flatnonzero(over).tolist():
            self._truncate(slot_reqs[slots[i]], int(new_computed[i]))
        # the deltas: live rows only, their tokens cut at the stop
        token_row = np.repeat(np.arange(n), emitted)
        within = np.arange(int(starts[-1])) - starts[token_row]
        rows = np.flatnonzero(live)
        index_of = np.cumsum(live) - 1  # row -> index among the live rows
        cols.add_columns(
            dec.req_ids[rows],
            kept[rows],
            out.token_ids[: starts[-1]][within < kept[token_row]],
            d[rows],
            accepted[rows],
            {int(index_of[i]): f for i, f in finish.items()},
            {
                int(index_of[i]): lps[: kept_l[i]]
                for i, lps in out.logprobs.items()
                if i < n and live[i]
            },
        )

    def _apply_prefill(
        self, q: ReqPlan, out, row: int, tokens: list[int], cols, followed: bool
    ) -> None:
        req = self._requests.get(q.req_id)
        if req is None or not req.is_live or req.slot != q.slot:
            return  # aborted or preempted meanwhile: its tokens are dropped
        if q.num_computed == 0:  # (a prefill from the start: a new request or a recompute)
            req.drafter_followed = 0
        if followed and req.drafter_followed == q.num_computed:
            # the drafter computed this chunk: it continued the draft KV it had
            req.drafter_followed += q.num_new
        req.num_computed += q.num_new
        if not q.sample:
            return
        req.state = ReqState.DECODING
        # the drafter has seen the context as far as it followed the prefill
        req.drafter_lag = req.num_prefill_target - req.drafter_followed
        self._cohort_changed = True
        keep, reason, stop_reason = self._stop_in_run(req, tokens)
        req.output_token_ids += tokens[:keep]
        self._start_decoding(req)
        if reason is not None:
            req.state = ReqState.FINISHED
            req.finish_reason = reason
            req.stop_reason = stop_reason
            self._end_decoding(req)
            self._to_release.append(req)
        else:
            self._truncate(req, req.num_computed)
        lps = out.logprobs.get(row)
        cols.add_row(
            req.req_id,
            tokens[:keep],
            (reason, stop_reason) if reason is not None else None,
            lps[:keep] if lps is not None else None,
        )

    def _stop_in_run(self, req: Request, tokens: list[int]):
        """(tokens kept, finish reason or None, stop reason) of a request's emitted run: cut at
        the first stop (EOS and stop ids once min_tokens are out, max_tokens, stop strings)."""
        spec = req.spec
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
        if self.stop_checker is not None and keep:
            hit = self.stop_checker(req.req_id, tuple(tokens[:keep]))
            if hit is not None:
                keep, stop_reason = min(hit[0], keep), hit[1]
                finish = "stop"
        return keep, finish, stop_reason

    # ---------------------------------------------------------------- observability

    @property
    def num_running(self) -> int:
        return len(self._live)

    @property
    def num_policy_switches(self) -> int:
        return self._num_switches

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
