"""The engine: one synchronous loop that connects scheduler and executor.

Each `step()` is schedule -> run -> update: `Scheduler.plan`; `RoundExecutor.launch`; then
`RoundExecutor.finish` and `Scheduler.update`. Between launch and finish, while the device
computes, the host turns the previous round's deltas into client outputs (detokenization, stop
strings) and the scheduler decides the next round ahead (`prepare_decision`); a round's outputs
are handed out by the next step. An AR-only round may stay in flight instead (`RoundInFlight`;
`advance` on both sides counts its tokens and keeps them on the device): the next step plans
(if `may_plan_ahead`) and launches behind it, then finishes it, so rounds are updated in launch
order and the host's work between rounds runs behind the device's. A stop string in round N's
tokens ends the request at once: round N+1's tokens of it are dropped, round N+2 no longer plans
it; an aborted request emits nothing more; a failing launch or finish fails its round's requests
only. Not thread-safe: the server drives it from one thread, `LLM` from the caller's.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from executor.precompile import compile_attention_variants
from executor.structured.grammar import GrammarError, compiler_for
from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile import resolve_cost_model
from hipfire_serve.engine_outputs import RequestTable, StepOutputs
from hipfire_serve.engine_setup import build_engine_parts
from hipfire_serve.round_stats import EngineStats, RoundRecorder, RoundStats
from hipfire_serve.types import RequestOutput, SamplingParams
from scheduler.cost_model import CostModel
from scheduler.plan import Emitted, PhaseTimes, RoundPlan, RoundResult
from scheduler.request import RequestSpec, RoundDeltas
from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig, max_chunk_rows

if TYPE_CHECKING:
    from executor.pending_round import PendingRound

log = logging.getLogger("hipfire_serve.engine")
# whether freeze_heap has registered the unfreeze that lets the exit collection finalise the set-up
_UNFREEZE_AT_EXIT = False

__all__ = [
    "ContextLengthError",
    "Engine",
    "EngineStats",
    "QueueFullError",
    "RoundInFlight",
    "RoundStats",
]


class ContextLengthError(ValueError):
    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int):
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_len} prompt tokens and max_tokens {max_tokens} ({prompt_len + max_tokens} "
            f"in total)"
        )


@dataclass(frozen=True)
class RoundInFlight:
    """A launched AR-only round left running: the next step plans and launches behind it."""

    plan: RoundPlan
    launched: PendingRound
    plan_s: float  # host time of its Scheduler.plan


class Engine:
    def __init__(self, config: EngineConfig, tenants: Sequence = (), *, warmup: bool = True):
        config.validate()
        self.config = config
        parts = build_engine_parts(config)
        self.device = parts.device
        self.target_dir, self.draft_spec = parts.target_dir, parts.draft_spec
        self.tokenizer = parts.tokenizer
        self.target = parts.target
        self.model_name = parts.model_name
        self.max_model_len = parts.max_model_len
        self.num_kv_blocks = parts.num_kv_blocks
        self.drafter = parts.drafter
        self.executor = parts.executor
        # structured outputs: grammars compiled over the tokenizer, matchers in the executor
        self.grammars, self._no_grammars = (
            compiler_for(self.target_dir, self.target.config.vocab_size, self._eos_ids())
            if self.tokenizer is not None
            else (None, "the model has no tokenizer")
        )
        self.executor.constraints.compiler = self.grammars
        self._tenants = tuple(tenants)
        self._next_id = 0
        self._requests = RequestTable(self.tokenizer)
        self._recorder = RoundRecorder()
        self._uncollected: RoundDeltas | None = None  # the last round's, for the next step
        self._in_flight: RoundInFlight | None = None
        # a scheduler before the cost model: measuring a profile runs rounds on this engine
        self.scheduler = self.make_scheduler(config.spec_mode)
        self.install_cost_model(resolve_cost_model(self))
        if warmup:
            self._warmup()

    # -- the scheduler ------------------------------------------------------------------------
    def make_scheduler(
        self, spec_mode: str, cost_model: CostModel | None = None, policy=None
    ) -> Scheduler:
        """A fresh scheduler for this engine's slots, KV blocks and tenants; `spec_mode` is
        'ar' without a drafter, `policy` (a SpecPolicy) replaces the mode's own."""
        config = self.config
        return Scheduler(
            SchedulerConfig(
                max_concurrency=config.max_concurrency,
                max_queue=config.max_queue,
                spec_mode=spec_mode if self.drafter is not None else "ar",
                spec_depth=config.spec_depth,
                block_size=config.block_size,
                max_prefill_tokens=config.max_prefill_tokens,
                max_model_len=self.max_model_len,
                has_drafter=self.drafter is not None,
                draft_kv_lookahead=int(getattr(self.drafter, "kv_lookahead", 0)),
                # a hybrid target's recurrent state has no per-block snapshot to share
                enable_prefix_caching=config.enable_prefix_caching
                and not getattr(self.target, "is_hybrid", False),
                shared_prefix_cache=config.shared_prefix_cache,
                # the mode where the drafter can follow (a draft model), else off
                drafter_follows_prefill=(
                    config.drafter_follows_prefill if self.executor.follow_prefill else "off"
                ),
            ),
            num_kv_blocks=self.num_kv_blocks,
            cost_model=cost_model,
            tenants=self._tenants,
            policy=policy,
        )

    def install_scheduler(self, scheduler: Scheduler) -> None:
        """Serves with `scheduler` from the next step on; the engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("the scheduler can only be replaced while the engine is idle")
        self.scheduler = scheduler
        self._recorder.switches_seen = scheduler.num_policy_switches

    def install_cost_model(self, cost_model: CostModel | None) -> None:
        """Serves with a fresh scheduler of the configured mode pricing rounds by `cost_model`
        (None: the scheduler's default, which online calibration corrects)."""
        self.install_scheduler(self.make_scheduler(self.config.spec_mode, cost_model))

    def install_drafter(self, drafter, follows_prefill: bool = False) -> None:
        """Drafts with `drafter` from the next round on (the engine must be idle); a scheduler
        made afterwards plans for it. `follows_prefill`: it computes prefill chunks' KV in
        their rounds (a draft model only)."""
        if self.has_unfinished():
            raise RuntimeError("the drafter can only be replaced while the engine is idle")
        layer_ids = getattr(drafter, "capture_layer_ids", None)
        capture = self.executor.capture
        if layer_ids and (capture is None or capture.layer_ids != tuple(layer_ids)):
            raise ValueError("a drafter reading hidden states is set up with the executor")
        self.drafter = self.executor.drafter = drafter
        self.executor.drafter_follows_prefill = follows_prefill

    def request_ids(self) -> list[str]:
        """The client requests the engine holds now (running, waiting or finishing)."""
        return list(self._requests)

    @contextmanager
    def throwaway_scheduler(self, spec_mode: str, policy=None) -> Iterator[Scheduler]:
        """Inside the block a fresh scheduler of `spec_mode` (or `policy`) without a cost
        profile serves (a measurement, the warm-up); the engine's own is put back after, as it
        was. The engine must be idle on entry."""
        serving, switches_seen = self.scheduler, self._recorder.switches_seen
        self.install_scheduler(self.make_scheduler(spec_mode, None, policy))
        try:
            yield self.scheduler
        finally:
            self.scheduler = serving
            self._recorder.switches_seen = switches_seen

    # -- set-up -------------------------------------------------------------------------------
    def _warmup(self) -> None:
        """Runs one short request through prefill, AR and (with a drafter) speculative rounds
        before serving, so one-time costs (allocator growth, kernel compilation, graph capture
        of small buckets) never reach the cost model's calibration or a client's latency. It
        runs on a throw-away scheduler: nothing of the warm-up is kept."""
        self._compile_attention()
        vocab = self.target.config.vocab_size
        # a prompt across a block boundary, then enough tokens for prefill, AR and spec rounds,
        # all within the context limit
        prompt_len = max(1, min(2 * self.config.block_size + 3, self.max_model_len // 2))
        prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
        max_tokens = max(1, min(2 * self.config.spec_depth + 2, self.max_model_len - prompt_len))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        failed = False
        with self.throwaway_scheduler("spec"):
            self.add_request("__warmup__", prompt, params)
            while self.has_unfinished():
                for out in self.step():
                    failed |= any(c.finish_reason == "error" for c in out.outputs)
        if failed:  # a set-up that cannot run one round must not start serving
            raise RuntimeError("the warm-up round failed on this device (the log has the error)")
        self._recorder.clear()
        self._next_id = 0
        self.freeze_heap()

    def freeze_heap(self) -> None:
        """Moves every object alive now (models, caches, graphs, tables: the long-lived set-up)
        out of the garbage collector's generations, so a full collection during serving scans
        only what serving allocates instead of stalling a round for the whole heap. They are
        handed back at exit, so the interpreter's last collection still finalises them."""
        global _UNFREEZE_AT_EXIT
        gc.collect()
        gc.freeze()
        if not _UNFREEZE_AT_EXIT:
            atexit.register(gc.unfreeze)
            _UNFREEZE_AT_EXIT = True

    def _compile_attention(self) -> None:
        """Compiles every attention kernel variant the rounds can pick (GPU only), so no serving
        round waits for a compile."""
        if self.device.type != "cuda":
            return
        cfg = self.config
        t0 = time.perf_counter()
        num = compile_attention_variants(
            self.executor,
            max_q_len=max(max_chunk_rows(cfg.max_prefill_tokens), cfg.spec_depth),
        )
        log.info("compiled %d attention variants in %.1f s", num, time.perf_counter() - t0)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        tenant: str = "default",
        arrival_time: float | None = None,
    ) -> None:
        params.validate()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name} has no tokenizer: send token ids")
            prompt_ids = self.tokenizer.encode(prompt)
            prompt_text: str | None = prompt
        else:
            prompt_ids = [int(t) for t in prompt]
            prompt_text = None
            vocab = self.target.config.vocab_size
            bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(len(prompt_ids), params.max_tokens, self.max_model_len)
        self._check_constraints(params)
        eos = () if params.ignore_eos else tuple(self._eos_ids())
        now = time.monotonic() if arrival_time is None else arrival_time
        specs = []
        for index in range(params.n):
            req_id = self._next_id
            self._next_id += 1
            seed = None if params.seed is None else params.seed + index
            specs.append(
                RequestSpec(
                    req_id=req_id,
                    prompt_token_ids=tuple(prompt_ids),
                    sampling=params.to_spec(seed),
                    max_tokens=params.max_tokens,
                    min_tokens=params.min_tokens,
                    eos_token_ids=eos,
                    stop_token_ids=tuple(params.stop_token_ids or ()),
                    tenant=tenant,
                    speculation=params.speculation,
                    arrival_time=now,
                    cache_salt=params.cache_salt,
                )
            )
        added: list[int] = []
        try:
            for spec in specs:
                self.scheduler.add_request(spec)
                added.append(spec.req_id)
        except Exception:
            for req_id in added:  # n > 1 is all or nothing
                self.scheduler.abort(req_id)
            raise
        choice_ids = [spec.req_id for spec in specs]
        self._requests.add(request_id, prompt_text, prompt_ids, params, choice_ids)

    def _eos_ids(self) -> tuple[int, ...]:
        tokenizer = self.tokenizer
        return tuple(tokenizer.eos_token_ids if tokenizer else self.target.config.eos_token_ids)

    def _check_constraints(self, params: SamplingParams) -> None:
        """ValueError naming the field for a logit bias outside the vocabulary or a grammar
        that cannot be compiled; a good grammar is compiled here, before admission (cached)."""
        vocab = self.target.config.vocab_size
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        so = params.structured_outputs
        if so is None:
            return
        if self.grammars is None:
            raise ValueError(f"{so.field} is not available: {self._no_grammars}")
        try:
            self.grammars.compile(so.grammar_spec())
        except GrammarError as exc:
            raise ValueError(f"{so.field} cannot be compiled: {exc}") from None

    def abort(self, request_id: str) -> None:
        # The scheduler emits no delta for an aborted request, so its bookkeeping goes now
        # (otherwise has_unfinished() would stay true and the loop would spin on empty rounds).
        for req_id in self._requests.remove(request_id):
            self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.scheduler.has_work() or self._in_flight is not None

    @property
    def round_in_flight(self) -> RoundInFlight | None:
        """The AR round the last step left running, if any."""
        return self._in_flight

    # -- the round ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = StepOutputs()
        behind, self._in_flight = self._in_flight, None
        # schedule; behind a round in flight only while the policy keeps to AR (speculating
        # needs that round's tokens on the host)
        plan, plan_s = None, 0.0
        if behind is None or self.scheduler.may_plan_ahead():
            t0 = time.perf_counter()
            plan = self.scheduler.plan(time.monotonic())
            plan_s = time.perf_counter() - t0
        # run: launch (behind the round in flight, whose tokens it reads on the device), then
        # that round's update and the earlier outputs while the device computes
        launched, failed = self._launch(plan)
        if behind is not None:
            self._finish(behind, out, collect_s=0.0)
        t_collect = time.perf_counter()
        self._requests.collect(out, self._take_uncollected(), self.scheduler.stop)
        if failed:  # after the update of the round in flight: updates go in launch order
            self._fail_round(plan, out)
        if launched is None:
            return self._requests.forget_finished(self._requests.build(out))
        round_ = RoundInFlight(plan, launched, plan_s)
        ready = self._requests.build(out)
        if self.config.overlap_rounds and self.executor.can_advance(launched):
            self.executor.advance(launched)
            self.scheduler.advance(plan)
            self._in_flight = round_
            self.scheduler.prepare_decision()
            return self._requests.forget_finished(ready)
        self.scheduler.prepare_decision()
        # update
        if not self._finish(round_, out, collect_s=time.perf_counter() - t_collect):
            ready = self._requests.build(out)  # the collected outputs and the failed requests
        return self._requests.forget_finished(ready)

    def _launch(self, plan: RoundPlan | None) -> tuple[PendingRound | None, bool]:
        """Launches `plan` unless it has nothing to run. -> (launched round, whether it failed)"""
        if plan is None or not (plan.num_reqs or plan.setup or plan.release):
            return None, False
        try:
            return self.executor.launch(plan), False
        except Exception:
            log.exception("round %d failed; failing its %d requests", plan.round_id, plan.num_reqs)
            return None, True

    def _finish(self, round_: RoundInFlight, out: StepOutputs, collect_s: float) -> bool:
        """Waits for a launched round and hands its result to the scheduler; its deltas wait
        for the next collection. On failure the round's requests fail (into `out`) and False
        is returned."""
        plan = round_.plan
        try:
            result = self.executor.finish(round_.launched)
        except Exception:
            log.exception("round %d failed; failing its %d requests", plan.round_id, plan.num_reqs)
            self._fail_round(plan, out)
            return False
        t0 = time.perf_counter()
        self._uncollected = self.scheduler.update(result, time.monotonic())
        update_s = time.perf_counter() - t0
        self._recorder.record(
            plan,
            result,
            num_policy_switches=self.scheduler.num_policy_switches,
            plan_s=round_.plan_s,
            collect_s=collect_s,
            update_s=update_s,
        )
        return True

    def _take_uncollected(self) -> RoundDeltas | None:
        deltas, self._uncollected = self._uncollected, None
        return deltas

    def _fail_round(self, plan: RoundPlan, out: StepOutputs) -> None:
        """The scheduler takes the round as having emitted nothing, then aborts its requests;
        their clients get finish reason "error"."""
        zeros = np.zeros(plan.num_reqs, dtype=np.int64)
        req_ids = [q.req_id for q in plan.reqs]
        empty = RoundResult(
            round_id=plan.round_id,
            out=Emitted.build(req_ids, zeros, (), zeros, zeros),
            timings=PhaseTimes(),
            num_rows=0,
            num_padded_rows=0,
            num_kv_tokens=0,
        )
        self.scheduler.update(empty, time.monotonic())
        for req_id in req_ids:
            self.scheduler.abort(req_id)
        self._requests.fail(out, req_ids)

    # -- observability ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine, with the round records since the last call."""
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            slot_capacity=self.config.max_concurrency,
            live_slots=s.num_running,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=s.kv.num_free,
            rounds=self._recorder.drain(),
        )
