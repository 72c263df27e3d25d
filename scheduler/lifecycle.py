"""Request lifecycle: the waiting queue (tenant-fair), the slot pool and admission.

WAITING -> (admitted into a free slot) PREFILLING -> (its last chunk samples the first token)
DECODING -> FINISHED; ABORTED from any state. A finished, aborted or preempted request's slot
and KV blocks go back in the next plan's `release`. A slot released by a plan is reused from
the following plan on, so an executor may apply `release` and `setup` in either order.
"""

from __future__ import annotations

import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.kv_blocks import BlockPool, num_blocks_for
from scheduler.pending_outcomes import PendingOutcomes
from scheduler.plan import Mode, SeqSetup
from scheduler.prefix_cache import PrefixCache
from scheduler.request import SPECULATION_CHOICES, ReqState, Request, RequestSpec
from scheduler.slot_table import SlotTable
from scheduler.stats import SchedulerCounters
from scheduler.tenants import FairAdmission


class QueueFullError(RuntimeError):
    """The backlog is at --max-queue; the server answers 503."""


class SlotChanges:
    """The slots a plan being made sets up and releases (filled while it is made)."""

    __slots__ = ("released", "setups")

    def __init__(self):
        self.setups: list[SeqSetup] = []
        self.released: list[int] = []


class RequestLifecycle:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: BlockPool,
        slot_table: SlotTable,
        admission: FairAdmission,
        outcomes: PendingOutcomes,
        counters: SchedulerCounters,
        prefix_cache: PrefixCache,
    ):
        self.config = config
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.slot_table = slot_table
        self.admission = admission
        self.outcomes = outcomes
        self.counters = counters
        self.requests: dict[int, Request] = {}  # every request not yet released
        self.live: list[Request] = []  # requests holding a slot, in admission order
        self.free_slots: list[int] = list(range(config.max_concurrency - 1, -1, -1))
        self.to_release: list[Request] = []  # finished/aborted/preempted, freed by next plan
        self.stop_ids: set[int] = set()  # every EOS / stop token id of any request
        self.stop_ids_arr = np.zeros(0, dtype=np.int64)
        self.cohort_changed = True  # arrivals or departures since the last plan
        self._admit_seq = 0

    # ---------------------------------------------------------------- requests in and out

    def add(self, spec: RequestSpec) -> None:
        if spec.req_id in self.requests:
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
        if not new_stop_ids <= self.stop_ids:
            self.stop_ids |= new_stop_ids
            self.stop_ids_arr = np.array(sorted(self.stop_ids), dtype=np.int64)
        self.requests[spec.req_id] = req
        self.admission.push(req)

    def abort(self, req_id: int) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_done:
            return
        if req.state == ReqState.WAITING:
            self.admission.remove(req)
            req.state = ReqState.ABORTED
            req.finish_reason = "abort"
            self.kv.free(req_id)
            del self.requests[req_id]
            return
        req.state = ReqState.ABORTED
        req.finish_reason = "abort"
        self.slot_table.end_decoding(req)
        self.to_release.append(req)

    def stop(self, req_id: int, num_output_tokens: int, stop_reason: int | str | None) -> None:
        req = self.requests.get(req_id)
        if req is None or req.state == ReqState.ABORTED:
            return
        del req.output_token_ids[num_output_tokens:]
        self.prefix_cache.forget_past(req, req.context_len)
        was_done = req.is_done
        req.state = ReqState.FINISHED
        req.finish_reason = "stop"
        req.stop_reason = stop_reason
        if was_done:
            return  # finished in the same round (EOS, length): already on its way out
        if req.slot < 0:  # preempted and waiting: it never runs again
            self.admission.remove(req)
            self.kv.free(req_id)
            del self.requests[req_id]
            return
        self.slot_table.end_decoding(req)
        self.to_release.append(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        """A stop inside the request's run: its slot and blocks go back in the next plan."""
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.slot_table.end_decoding(req)
        self.to_release.append(req)

    def has_work(self) -> bool:
        return bool(self.live or self.admission.num_waiting or self.to_release)

    # ---------------------------------------------------------------- slots, per plan

    def release_finished(self, changes: SlotChanges) -> None:
        """The slots of finished, aborted and preempted requests go into this plan's release."""
        for req in self.to_release:
            if req.slot < 0:
                continue
            self._free_slot_state(req)
            changes.released.append(req.slot)
            self.admission.on_release(req.spec.tenant)
            req.slot = -1
            if req.is_done:
                self.requests.pop(req.req_id, None)
        if self.to_release:
            live_before = len(self.live)
            self.live = [r for r in self.live if r.is_live and r.slot >= 0]
            self.cohort_changed |= len(self.live) != live_before
        self.to_release = []

    def admit(self, changes: SlotChanges, now: float, round_id: int) -> None:
        """Waiting requests into free slots, tenant-fair, while the KV pool holds their context
        beside the prompts still in prefill and the watermark. A request starts from the cached
        blocks of its context's prefix: it needs blocks only for the rest, plus the cached ones
        nobody holds (taking them leaves fewer free)."""
        cfg = self.config
        kv = self.kv
        cache = self.prefix_cache
        if not self.free_slots or not self.admission.num_waiting:
            return  # the common case of a full server: no per-request work
        reserve = int(cfg.kv_watermark * kv.num_total) + sum(
            num_blocks_for(r.num_prefill_target + 1, kv.block_size) - kv.num_blocks_of(r.req_id)
            for r in self.live
            if r.state == ReqState.PREFILLING
        )
        while self.free_slots and len(self.live) < cfg.max_concurrency:
            req = self.admission.peek()
            if req is None:
                return
            need = num_blocks_for(req.context_len + 1, kv.block_size)
            hit = cache.hit(req)
            if cache.enabled and self.live and cache.should_wait(req, hit, self._prefilling_now()):
                return  # its prefix is being computed: it starts from the cache next round
            if hit:
                need -= len(hit)
                if need + kv.num_unreferenced(hit) > kv.num_free - reserve and self.live:
                    return
            elif need > kv.num_free - reserve and self.live:
                return  # wait for blocks; an empty server admits anyway (it fits alone)
            self.admission.pop(req)
            reserve += need
            req.slot = self.free_slots.pop()
            self.slot_table.assign(req)
            req.state = ReqState.PREFILLING
            cache.attach(req, hit)  # num_computed: the cached prefix
            self.slot_table.num_blocks[req.slot] = len(hit)
            req.num_prefill_target = req.context_len
            req.admit_seq = self._admit_seq
            self._admit_seq += 1
            req.admit_time = now
            req.last_mode = Mode.PREFILL  # no decode decision yet
            req.mode_since_round = round_id
            req.drafter_lag = 0
            # a drafter of its own KV has none of a cached prefix: it catches up from 0
            req.drafter_followed = 0
            self.outcomes.reset_slot(req.slot)
            self.live.append(req)
            self.cohort_changed = True
            changes.setups.append(
                SeqSetup(
                    req_id=req.req_id,
                    slot=req.slot,
                    context_token_ids=req.context_token_ids(),
                    sampling=req.spec.sampling,
                    num_output_tokens=req.num_output,
                    cached_block_ids=tuple(hit),
                    num_cached_tokens=req.num_computed,
                )
            )

    def preempt(self, req: Request, changes: SlotChanges) -> None:
        """Back to the front of its tenant's queue; recomputed from its context later."""
        self._free_slot_state(req)
        setup_now = [s for s in changes.setups if s.req_id == req.req_id]
        if setup_now:  # admitted by this very plan: the executor never hears of it
            changes.setups.remove(setup_now[0])
            self.free_slots.append(req.slot)
        else:
            changes.released.append(req.slot)
        self.admission.on_release(req.spec.tenant)
        req.slot = -1
        req.state = ReqState.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.admission.push(req, front=True)
        self.live.remove(req)
        self.cohort_changed = True

    def _prefilling_now(self) -> list[Request]:
        """The live requests in prefill, found by state (admission's own check; `prefilling`
        may skip the scan)."""
        return [r for r in self.live if r.state == ReqState.PREFILLING]

    def prefilling(self) -> list[Request]:
        """The live requests in prefill, in admission order."""
        if not self.slot_table.may_hold_prefilling(len(self.live)):
            return []
        return [r for r in self.live if r.state == ReqState.PREFILLING]

    def reuse_slots(self, released: list[int]) -> None:
        """Slots a plan released become reusable from the next plan on."""
        self.free_slots.extend(released)

    def _free_slot_state(self, req: Request) -> None:
        """Returns the request's KV blocks and clears its slot's row (the slot index itself is
        handed back by the caller). Its full blocks of committed KV stay cached: private ones
        not cached yet are registered first, shared ones just lose a reference."""
        if self.prefix_cache.enabled:
            if req.num_computed >= req.num_prefill_target:  # it decoded: the columns know
                # (positions past the context's last token are not committed: an advanced
                # round may be computing one, a stop may have cut the context before it)
                committed = min(int(self.slot_table.num_computed[req.slot]), req.context_len - 1)
            else:
                committed = req.num_computed
            self.prefix_cache.commit(req, committed)
        self.kv.free(req.req_id)
        self.slot_table.end_decoding(req)
        self.slot_table.clear(req.slot)
