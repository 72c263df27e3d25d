"""The scheduler: the facade the engine and the simulator drive, one round at a time. Torch-free.

    plan = scheduler.plan(now); result = executor.run(plan); deltas = scheduler.update(result, now)

Its parts, one job each: `lifecycle` (waiting queue, tenant-fair admission, slot pool),
`kv_reservation` (KV blocks for a round's rows, preemption), `prefill_chunks` (the prefill
budget), `policy_view` and `round_decision` (the speculation decision, made in plan() or ahead
of it), `follow_prefill` (whether the drafter follows prefill chunks), `round_builder` (the
RoundPlan), `rounds_in_flight` (plans not yet updated, the advanced round), `round_update`
(applying a RoundResult), `prefix_cache` (KV blocks found by their content) and `stats`.
Decoding requests keep their state in per-slot columns (`slot_table`) that the parts share.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.acceptance import AcceptanceEstimator, AcceptanceKnowledge
from scheduler.config import FOLLOW_MODES, SchedulerConfig
from scheduler.cost_model import CostModel, ProfileCost
from scheduler.follow_prefill import FollowPrefillChoice
from scheduler.kv_blocks import BlockPool
from scheduler.kv_reservation import KVReservation
from scheduler.lifecycle import QueueFullError, RequestLifecycle, SlotChanges
from scheduler.pending_outcomes import PendingOutcomes
from scheduler.plan import RoundPlan, RoundResult
from scheduler.policy import (
    AdaptivePolicy,
    AllARPolicy,
    AllSpecPolicy,
    RateTracker,
    YieldTracker,
)
from scheduler.policy_api import SpecPolicy
from scheduler.policy_view import PolicyViews
from scheduler.prefill_chunks import (
    PREFILL_TAIL_DIV,
    PrefillChunk,
    choose_chunks,
    max_chunk_rows,
    prefill_tail_rows,
)
from scheduler.prefix_cache import PrefixCache
from scheduler.request import ReqState, RequestSpec, RoundDeltas
from scheduler.round_builder import RoundBuilder
from scheduler.round_decision import RoundDecider
from scheduler.round_update import ResultApplier
from scheduler.rounds_in_flight import InflightRound, RoundsInFlight
from scheduler.slot_table import SlotTable
from scheduler.stats import SchedulerCounters, SchedulerStats, snapshot
from scheduler.stops import StopChecker
from scheduler.tenants import FairAdmission, TenantSpec

__all__ = [
    "FOLLOW_MODES",
    "PREFILL_TAIL_DIV",
    "QueueFullError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StopChecker",
    "max_chunk_rows",
    "prefill_tail_rows",
]


def default_profile() -> dict:
    """A flat profile for a scheduler without one: 10 ms per round plus 0.01 ms per row, a
    chain draft step of 1 ms (2 ms at 4096 rows). Online calibration scales it to the rounds
    it sees, per class and row bucket; the points at every power of two are those buckets, so
    it can learn how rounds grow with rows (little on a GPU, nearly linearly on a CPU).
    `hipfire_serve/cost_profile/default.py` reshapes its drafter part for a block drafter."""
    return {
        "target": {
            "rows_ms": [[1 << i, 10.0 + 0.01 * ((1 << i) - 1)] for i in range(13)],
            "kv_bytes_per_token": 0,
            "kv_read_TBps_assumed": 1.0,
        },
        "draft_model": {"rows_ms_per_step": [[1, 1.0], [4096, 2.0]]},
    }


def _default_cost_model() -> CostModel:
    return CostModel(ProfileCost(default_profile()))


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
        self.prefix_cache = PrefixCache(
            self.kv, config.enable_prefix_caching, config.shared_prefix_cache
        )
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
        self.policy = policy  # read at every decision: it may be replaced between rounds
        self.estimator = AcceptanceEstimator(
            config.max_concurrency, max(config.spec_depth - 1, 1), config.prior_acceptance
        )
        self.rate_tracker = RateTracker()
        self.yield_tracker = YieldTracker()
        self._round_id = 0
        self._last_plan: RoundPlan | None = None
        # tokens per ms of the latest plan's all-AR alternative: the basis the next result
        # feeds the rate tracker with
        self._latest_ar_rate = 0.0
        self._counters = SchedulerCounters()
        self._slot_table = SlotTable(config.max_concurrency)
        self._outcomes = PendingOutcomes(self.estimator)
        self._lifecycle = RequestLifecycle(
            config,
            self.kv,
            self._slot_table,
            self.admission,
            self._outcomes,
            self._counters,
            self.prefix_cache,
        )
        self._requests = self._lifecycle.requests  # every request not yet released, by id
        self._reservation = KVReservation(
            self.kv, self._slot_table, self._lifecycle, config.draft_kv_lookahead
        )
        self._in_flight = RoundsInFlight(self._slot_table)
        views = PolicyViews(
            config,
            self._slot_table,
            self._lifecycle,
            self.cost_model,
            self.rate_tracker,
            self.yield_tracker,
        )
        self._decider = RoundDecider(
            config, self._slot_table, views, self.estimator, self.cost_model, self._outcomes
        )
        self._follow = FollowPrefillChoice(
            config, self._lifecycle, views, self.estimator, self.cost_model
        )
        self._builder = RoundBuilder(
            self._slot_table, self._reservation, self.cost_model, self._counters
        )
        self._applier = ResultApplier(
            self._slot_table,
            self._lifecycle,
            self._reservation,
            self._in_flight,
            self._outcomes,
            self.cost_model,
            self.rate_tracker,
            self.yield_tracker,
            self._counters,
            stop_checker,
        )

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, spec: RequestSpec) -> None:
        self._lifecycle.add(spec)

    def abort(self, req_id: int) -> None:
        """Ends the request in any state; its slot and blocks go back in the next plan."""
        self._lifecycle.abort(req_id)

    def stop(self, req_id: int, num_output_tokens: int, stop_reason: int | str | None) -> None:
        """Ends a request at a stop found after update() (the engine matches stop strings while
        the next round runs): it keeps its first `num_output_tokens` outputs, the tokens of a
        round still in flight are dropped, and its slot and blocks go back in the next plan."""
        self._lifecycle.stop(req_id, num_output_tokens, stop_reason)

    def acceptance_knowledge(self) -> AcceptanceKnowledge:
        """What the estimator learned of the drafter on this traffic (prior, evidence,
        calibration), for a scheduler that replaces this one (`adopt_acceptance`)."""
        return self.estimator.knowledge()

    def adopt_acceptance(self, known: AcceptanceKnowledge) -> None:
        """Starts the estimator from what an earlier scheduler of the same drafter learned
        instead of the configured prior. Only before the first request: beliefs of live
        requests are not rewritten (RuntimeError otherwise)."""
        if self._lifecycle.requests:
            raise RuntimeError("adopt_acceptance on a scheduler that holds requests")
        self.estimator.adopt(known)

    def has_work(self) -> bool:
        return self._lifecycle.has_work()

    # ---------------------------------------------------------------- planning

    def plan(self, now: float) -> RoundPlan:
        self._round_id += 1
        round_id = self._round_id
        lifecycle = self._lifecycle
        changes = SlotChanges()
        lifecycle.release_finished(changes)
        lifecycle.admit(changes, now, round_id)
        chunks = choose_chunks(
            lifecycle.prefilling(), self.config.max_prefill_tokens, self._reservation, changes
        )
        # Decode rows: every decoding request gets at least its AR row, oldest first.
        num_preempted = self._counters.num_preemptions
        ar_rows = self._reservation.reserve_ar_rows(
            self._in_flight.decoding_slots(lifecycle.live), changes
        )
        slots, ar_blocks = ar_rows.slots, ar_rows.blocks
        if self._counters.num_preemptions != num_preempted:  # some made room for the AR rows
            ar_blocks = None
            slots = slots[self._slot_table.decoding[slots]]
            chunks = [c for c in chunks if c.req.slot >= 0]
        follow = bool(chunks) and self._follows_prefill(chunks)
        self.cost_model.drafter_prefill = follow  # the round's price includes the draft forward
        if self._in_flight.advanced is None:
            decision = self._decider.decide(
                self.policy, slots, chunks, round_id, lifecycle.cohort_changed
            )
        else:
            decision = self._decider.decide_behind(slots, chunks)
        built = self._builder.build(round_id, slots, decision, chunks, ar_blocks, follow, changes)
        plan = built.plan
        self._last_plan = plan
        self._latest_ar_rate = decision.ar_rate
        self._in_flight.add(
            InflightRound(
                plan, built.price.raw_ms, built.price.raw_alone_ms, decision.expected_accepted
            )
        )
        lifecycle.cohort_changed = False
        lifecycle.reuse_slots(changes.released)
        return plan

    def _follows_prefill(self, chunks: list[PrefillChunk]) -> bool:
        """Whether the drafter follows this round's prefill chunks (see follow_prefill)."""
        return self._follow.follows(
            chunks, self.policy, self._round_id, self._lifecycle.cohort_changed
        )

    def may_plan_ahead(self) -> bool:
        """Whether the next round can be planned while the advanced one runs: the policy's
        decision made ahead (prepare_decision) has no request speculating, or the server never
        speculates."""
        return self._decider.may_plan_ahead()

    def advance(self, plan: RoundPlan) -> None:
        """Counts the launched AR-only decode round `plan` as done, one token per request, so
        the next round can be planned (and launched) while it runs. Its update() later takes
        the count back and applies what really happened (stops, aborts)."""
        self._in_flight.advance(plan)

    def prepare_decision(self) -> None:
        """Makes the next round's speculation decision ahead of its plan(): the engine calls
        this while the device runs the current round, so the policy's search leaves the host
        time between rounds. It sees the request state and acceptance estimates of one round
        earlier (the running round's outcome is not known yet); plan() uses it only when the
        next round decodes exactly the same requests with no prefill chunk and no arrival or
        departure in between, and decides afresh otherwise."""
        slots = self._in_flight.decoding_slots(self._lifecycle.live)
        self._decider.prepare(
            self.policy, slots, self._round_id + 1, self._lifecycle.cohort_changed
        )

    # ---------------------------------------------------------------- results

    def update(self, result: RoundResult, now: float) -> RoundDeltas:
        return self._applier.apply(result, self._latest_ar_rate)

    # ---------------------------------------------------------------- observability

    @property
    def num_running(self) -> int:
        return len(self._lifecycle.live)

    @property
    def num_policy_switches(self) -> int:
        return self._counters.num_switches

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def num_free_slots(self) -> int:
        return len(self._lifecycle.free_slots)

    def request_state(self, req_id: int) -> ReqState | None:
        req = self._lifecycle.requests.get(req_id)
        return req.state if req is not None else None

    @property
    def stats(self) -> SchedulerStats:
        return snapshot(
            self._round_id,
            self._lifecycle.live,
            self.admission.num_waiting,
            self.kv,
            self._last_plan,
            self._counters,
            self.prefix_cache,
        )
