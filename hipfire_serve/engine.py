"""The engine: one synchronous loop that connects scheduler and executor.

`step()` runs one round: plan, launch it on the device, and while the device computes, turn what
the *previous* round emitted into per-request outputs (incremental detokenization, stop strings,
stream text); then wait for the round, and hand its result to the scheduler. A round's outputs
are therefore returned by the next `step()`. A stop string found in round N's tokens ends the
request at once (exact truncation), so round N+1's tokens of it are dropped and round N+2 no
longer plans it; a request aborted meanwhile emits nothing more. The engine is not thread-safe:
the server drives it from one thread, the offline `LLM` API from the caller's.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import torch

from executor.drafters.base import Drafter
from executor.kv_cache import KVCache, auto_kv_budget, parse_bytes
from executor.loader import load_model
from executor.model import Model
from executor.round_executor import RoundExecutor
from hipfire_serve.config import EngineConfig
from hipfire_serve.tokenizer import OutputStream, StreamStep, Tokenizer
from hipfire_serve.types import CompletionOutput, RequestOutput, SamplingParams
from scheduler.cost_model import CostModel
from scheduler.kv_blocks import num_blocks_for
from scheduler.plan import Emitted, PhaseTimes, RoundPlan, RoundResult
from scheduler.request import RequestSpec, RoundDeltas
from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig, max_chunk_rows

log = logging.getLogger("hipfire_serve.engine")
# whether freeze_heap has registered the unfreeze that lets the exit collection finalise the set-up
_UNFREEZE_AT_EXIT = False

__all__ = ["ContextLengthError", "Engine", "EngineStats", "QueueFullError", "RoundStats"]


class ContextLengthError(ValueError):
    def __init__(self, prompt_len: int, max_tokens: int, max_model_len: int):
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_len} prompt tokens and max_tokens {max_tokens} ({prompt_len + max_tokens} "
            f"in total)"
        )


class RoundStats(msgspec.Struct, kw_only=True):
    route: str
    num_rows: int
    num_padded_rows: int
    num_kv_tokens: int  # KV tokens the round's attention read (new rows included)
    num_spec: int
    num_ar: int
    num_prefill: int
    predicted_s: float
    measured_s: float
    phase_s: dict[str, float]
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]
    policy_switches: int
    reason: str
    overlapped: bool = False  # the next round was launched before this one finished
    # tokens the plan expected (one per decoding request, the drafts the estimators expect
    # accepted, prefills that complete)
    predicted_tokens: float = 0.0
    num_emitted: int = 0  # output tokens the round emitted (after stops)


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    slot_capacity: int
    live_slots: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    rounds: list[RoundStats] = msgspec.field(default_factory=list)


@dataclass
class _Choice:
    request_id: str
    index: int
    stream: OutputStream
    token_ids: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choice_ids: list[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA/HIP device is available")
    return device


RANDOM_PREFIX = "random:"
# The start-up profile: coarser than `hipfire-serve profile` (a few seconds on a GPU).
QUICK_PROFILE_ROWS = (1, 4, 16, 32, 64, 128, 256, 512)
QUICK_PROFILE_KV_LENS = (16, 1024)


class _TokenOnlyStream:
    """Output stream of a model without a tokenizer (random weights): ids only, no text."""

    def push(self, new_ids):
        return StreamStep("", None, len(new_ids))

    def finish(self):
        return StreamStep("", None, 0)


def resolve_model_dirs(config: EngineConfig) -> tuple[Path, str]:
    """Returns (target dir, drafter spec: a directory, 'ngram', 'synthetic' or 'none')."""
    if config.model == "demo":
        from hipfire_serve.demo import demo_draft_dir, demo_model_dir

        target = demo_model_dir()
        draft = str(demo_draft_dir()) if config.draft == "auto" else config.draft
    else:
        target = Path(config.model)
        draft = "none" if config.draft == "auto" else config.draft
    return target, draft


class Engine:
    def __init__(self, config: EngineConfig, tenants: Sequence = (), *, warmup: bool = True):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        target_dir, draft_spec = resolve_model_dirs(config)
        self.target_dir, self.draft_spec = target_dir, draft_spec
        self.tokenizer: Tokenizer | None
        if config.model.startswith(RANDOM_PREFIX):
            # random weights of a real shape: benchmarks only, token-id prompts, no text
            self.tokenizer = None
            self.target: Model = self._random_model(config.model)
            self.model_name = config.model
        else:
            self.tokenizer = Tokenizer.from_dir(target_dir)
            self.target = load_model(target_dir, dtype=config.dtype, device=self.device)
            self.model_name = target_dir.name if config.model != "demo" else "hipfire-demo"
        limit = config.max_model_len or self.target.config.max_position
        self.max_model_len = min(limit, self.target.config.max_position)

        draft_model = None
        # a synthetic drafter may run a draft model for its cost: that model is loaded here too
        model_spec = config.synthetic_cost_drafter if draft_spec == "synthetic" else draft_spec
        if model_spec.startswith(RANDOM_PREFIX):
            draft_model = self._random_model(model_spec, seed=1)
        elif model_spec not in ("none", "ngram", "synthetic"):
            draft_model = load_model(
                model_spec, dtype=str(self.target.dtype).split(".")[-1], device=self.device
            )
            if draft_model.config.vocab_size != self.target.config.vocab_size:
                raise ValueError(
                    f"draft model vocabulary ({draft_model.config.vocab_size}) differs from the "
                    f"target's ({self.target.config.vocab_size})"
                )
        budget = (
            auto_kv_budget(self.device)
            if config.kv_cache_memory == "auto"
            else parse_bytes(config.kv_cache_memory)
        )
        configs = [self.target.config] + ([draft_model.config] if draft_model else [])
        num_blocks = KVCache.blocks_for_budget(
            configs, budget, config.block_size, self.target.dtype
        )
        min_blocks = num_blocks_for(self.max_model_len + config.spec_depth, config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache budget holds {num_blocks} blocks but one full-length request needs "
                f"{min_blocks}: raise --kv-cache-memory or lower --max-model-len"
            )
        self.num_kv_blocks = num_blocks
        slots = config.max_concurrency
        self.drafter: Drafter | None = self._make_drafter(draft_spec, draft_model, num_blocks)
        self.executor = RoundExecutor(
            self.target,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_slots=slots,
            max_model_len=self.max_model_len + config.spec_depth,
            drafter=self.drafter,
            base_seed=config.seed,
            graphs=config.graphs,
            max_graph_rows=slots * config.spec_depth,
            drafter_follows_prefill=config.drafter_follows_prefill != "off",
        )
        self._tenants = tuple(tenants)
        self._next_id = 0
        self._requests: dict[str, _Request] = {}
        self._choices: dict[int, _Choice] = {}
        self._rounds: list[RoundStats] = []
        self._num_switches = 0
        self._pending: RoundDeltas | None = None  # the last round's deltas, not yet collected
        # (plan, launched round, plan seconds) of an advanced AR round still running
        self._ahead: tuple | None = None
        self.scheduler = self._make_scheduler(config.spec_mode, self._load_cost_model())
        if warmup:
            self._warmup()

    def _make_scheduler(self, spec_mode: str, cost_model: CostModel | None) -> Scheduler:
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
                # the mode where the drafter can follow (a draft model), else off
                drafter_follows_prefill=(
                    config.drafter_follows_prefill if self.executor.follow_prefill else "off"
                ),
            ),
            num_kv_blocks=self.num_kv_blocks,
            cost_model=cost_model,
            tenants=self._tenants,
        )

    def _warmup(self) -> None:
        """Runs one short request through prefill, AR and (with a drafter) speculative rounds
        before serving, so one-time costs (allocator growth, kernel compilation, graph capture
        of small buckets) never reach the cost model's calibration or a client's latency. The
        scheduler used for it is then replaced by a fresh one: nothing of the warm-up is kept."""
        self._compile_attention()
        serving = self.scheduler
        self.scheduler = self._make_scheduler("spec", None)
        vocab = self.target.config.vocab_size
        # a prompt across a block boundary, then enough tokens for prefill, AR and spec rounds,
        # all within the context limit
        prompt_len = max(1, min(2 * self.config.block_size + 3, self.max_model_len // 2))
        prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
        max_tokens = max(1, min(2 * self.config.spec_depth + 2, self.max_model_len - prompt_len))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.add_request("__warmup__", prompt, params)
        failed = False
        while self.has_unfinished():
            for out in self.step():
                failed |= any(c.finish_reason == "error" for c in out.outputs)
        self.scheduler = serving
        if failed:  # a set-up that cannot run one round must not start serving
            raise RuntimeError("the warm-up round failed on this device (the log has the error)")
        self._rounds.clear()
        self._num_switches = 0
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
        """Compiles every attention kernel variant the target's and the draft model's rounds
        can pick (GPU only), so no serving round waits for a compile: a drafter catching up
        after AR rounds or a new prefill shape would otherwise stall for seconds."""
        if self.device.type != "cuda":
            return
        from kernels.attention import compile_variants, verify_attention

        cfg = self.config
        models = [(self.target, self.executor.kv)]
        inner = getattr(self.drafter, "inner", self.drafter)
        if getattr(inner, "model", None) is not None and getattr(inner, "kv", None) is not None:
            models.append((inner.model, inner.kv))
        t0 = time.perf_counter()
        num = 0
        for model, kv in models:
            if model.ops.verify_attention is not verify_attention:
                continue  # torch reference ops: nothing to compile
            num += compile_variants(
                kv.k[0],
                kv.v[0],
                model.config.num_q_heads,
                max_seqs=cfg.max_concurrency,
                max_q_len=max(max_chunk_rows(cfg.max_prefill_tokens), cfg.spec_depth),
                max_kv_len=self.executor.max_blocks_per_seq * cfg.block_size,
            )
        torch.cuda.synchronize(self.device)
        log.info("compiled %d attention variants in %.1f s", num, time.perf_counter() - t0)

    # -- set-up helpers ---------------------------------------------------------------------
    def _random_model(self, spec: str, seed: int = 0) -> Model:
        from executor.loader import resolve_dtype
        from executor.random_model import PRESETS, random_model

        name = spec[len(RANDOM_PREFIX) :]
        if name not in PRESETS:
            raise ValueError(f"unknown random model {name!r} (choose {', '.join(PRESETS)})")
        dtype = resolve_dtype(self.config.dtype, PRESETS[name], self.device)
        max_pos = min(PRESETS[name].max_position, self.config.max_model_len or 8192) + 64
        return random_model(name, device=self.device, dtype=dtype, seed=seed, max_position=max_pos)

    def _load_cost_model(self) -> CostModel | None:
        """The scheduler's cost model. A path: that profile. 'auto': the cached profile of these
        models on this device (`hipfire-serve profile` writes it); without one, on a GPU a quick
        profile is measured now and cached, on a CPU the scheduler's flat default is used (online
        calibration corrects it). 'build': measure and cache now, on any device."""
        path = self.config.cost_profile
        if path in ("auto", "build"):
            from executor.profiler import build_profile, cached_profile_path, profile_key

            key = profile_key(
                str(self.target_dir),
                self.draft_spec,
                self.device,
                self.target.dtype,
                self.config.block_size,
                self.config.max_concurrency,
            )
            cached = cached_profile_path(key)
            build = path == "build" or (not cached.is_file() and self.device.type == "cuda")
            if build:
                log.info("measuring the cost profile of this set-up (cached for next time)")
                # (rows beyond slots x depth and contexts beyond the model are skipped there)
                profile = build_profile(
                    self, QUICK_PROFILE_ROWS, QUICK_PROFILE_KV_LENS, repeats=5, with_ceilings=False
                )
                profile["key"] = key
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(profile, indent=1))
            elif not cached.is_file():
                log.info("no cost profile cached for this set-up (run `hipfire-serve profile`)")
                return None
            path = str(cached)
        try:
            return CostModel.from_file(path)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"cannot read cost profile {path}: {e}") from None

    def _make_drafter(self, spec: str, draft_model: Model | None, num_blocks: int):
        if spec == "none":
            return None
        if spec == "ngram":
            from executor.drafters.ngram import NgramDrafter

            return NgramDrafter()
        if spec == "synthetic":
            from executor.drafters.synthetic import SyntheticDrafter

            inner = self._make_drafter(self.config.synthetic_cost_drafter, draft_model, num_blocks)
            path, _, cohort = self.config.acceptance_profile.rpartition(":")
            return SyntheticDrafter(path, cohort, seed=self.config.seed, inner=inner)
        from executor.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(
            draft_model,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            max_slots=self.config.max_concurrency,
            max_model_len=self.max_model_len + self.config.spec_depth,
        )

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
        eos_ids = (
            self.tokenizer.eos_token_ids if self.tokenizer else self.target.config.eos_token_ids
        )
        eos = () if params.ignore_eos else tuple(eos_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        choice_ids = []
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
                )
            )
            choice_ids.append(req_id)
        added: list[int] = []
        try:
            for spec in specs:
                self.scheduler.add_request(spec)
                added.append(spec.req_id)
        except Exception:
            for req_id in added:  # n > 1 is all or nothing
                self.scheduler.abort(req_id)
            raise
        for index, req_id in enumerate(choice_ids):
            self._choices[req_id] = _Choice(
                request_id=request_id,
                index=index,
                stream=self._make_stream(prompt_ids, params),
            )
        self._requests[request_id] = _Request(
            request_id, prompt_text, prompt_ids, params, choice_ids
        )

    def _make_stream(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return _TokenOnlyStream()
        return OutputStream(
            self.tokenizer,
            prompt_ids,
            stop_strings=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def abort(self, request_id: str) -> None:
        # The scheduler emits no delta for an aborted request, so its bookkeeping goes now
        # (otherwise has_unfinished() would stay true and the loop would spin on empty rounds).
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for req_id in req.choice_ids:
            if not self._choices.pop(req_id).finished:
                self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.scheduler.has_work() or self._ahead is not None

    # -- the round ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._ahead is not None:
            return self._step_behind()
        outputs: dict[str, dict[int, CompletionOutput]] = {}
        t0 = time.perf_counter()
        plan = self.scheduler.plan(time.monotonic())
        if not (plan.num_reqs or plan.setup or plan.release):
            self._collect(outputs, self._take_pending())
            return self._forget_finished(self._outputs(outputs))
        t1 = time.perf_counter()
        try:
            launched = self.executor.launch(plan)
        except Exception:
            log.exception("round %d failed; failing its %d requests", plan.round_id, plan.num_reqs)
            self._collect(outputs, self._take_pending())
            self._fail_round(plan, outputs)
            return self._forget_finished(self._outputs(outputs))
        t2 = time.perf_counter()
        # The previous round's per-output work, and the next round's speculation decision,
        # while the device runs this one.
        self._collect(outputs, self._take_pending())
        return self._forget_finished(self._run_out(plan, launched, outputs, t1 - t0, t2))

    def _step_behind(self) -> list[RequestOutput]:
        """A step while an advanced AR round runs: plan and launch the next round behind it
        (its AR rows read their input tokens from the running round on the device), then
        finish the running round and hand out its outputs while the device runs the next."""
        outputs: dict[str, dict[int, CompletionOutput]] = {}
        prev_plan, prev, prev_plan_s = self._ahead
        self._ahead = None
        if not self.scheduler.may_plan_ahead():
            # the policy wants speculation next, which needs the running round's tokens
            self._finish(prev_plan, prev, outputs, prev_plan_s, 0.0)
            self._collect(outputs, self._take_pending())
            return self._forget_finished(self._outputs(outputs))
        t0 = time.perf_counter()
        plan = self.scheduler.plan(time.monotonic())
        t1 = time.perf_counter()
        launched, failed = None, False
        if plan.num_reqs or plan.setup or plan.release:
            try:
                launched = self.executor.launch(plan)
            except Exception:
                log.exception(
                    "round %d failed; failing its %d requests", plan.round_id, plan.num_reqs
                )
                failed = True
        self._finish(prev_plan, prev, outputs, prev_plan_s, 0.0)
        t2 = time.perf_counter()
        self._collect(outputs, self._take_pending())
        if failed:  # after the running round's update: rounds are updated in launch order
            self._fail_round(plan, outputs)
        if launched is None:
            return self._forget_finished(self._outputs(outputs))
        return self._forget_finished(self._run_out(plan, launched, outputs, t1 - t0, t2))

    def _run_out(self, plan: RoundPlan, launched, outputs, plan_s: float, t_launched: float):
        """The rest of a step once `plan` is launched and the earlier outputs are collected
        into `outputs`: either leave an AR-only round running with its tokens counted (the next
        step plans behind it), or finish it. Returns the step's outputs."""
        ready = self._outputs(outputs)
        if self.config.overlap_rounds and self.executor.can_advance(launched):
            self.executor.advance(launched)
            self.scheduler.advance(plan)
            self._ahead = (plan, launched, plan_s)
            self.scheduler.prepare_decision()
            return ready
        self.scheduler.prepare_decision()
        t3 = time.perf_counter()
        if not self._finish(plan, launched, outputs, plan_s, t3 - t_launched):
            return self._outputs(outputs)  # the collected outputs and the failed requests
        return ready

    def _finish(self, plan: RoundPlan, launched, outputs, plan_s: float, collect_s: float) -> bool:
        """Waits for a launched round and hands its result to the scheduler; its deltas wait
        in `_pending` for the next collection. On failure the round's requests fail (into
        `outputs`) and False is returned."""
        try:
            result = self.executor.finish(launched)
        except Exception:
            log.exception("round %d failed; failing its %d requests", plan.round_id, plan.num_reqs)
            self._fail_round(plan, outputs)
            return False
        t4 = time.perf_counter()
        self._pending = self.scheduler.update(result, time.monotonic())
        t5 = time.perf_counter()
        self._record_round(plan, result, plan_s=plan_s, collect_s=collect_s, update_s=t5 - t4)
        return True

    def _take_pending(self) -> RoundDeltas | None:
        pending, self._pending = self._pending, None
        return pending

    def _fail_round(self, plan: RoundPlan, outputs) -> None:
        num = plan.num_reqs
        zeros = np.zeros(num, dtype=np.int64)
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
            choice = self._choices.get(req_id)
            if choice is None or choice.finished:
                continue
            choice.finished = True
            text = choice.stream.finish().text
            self._emit(outputs, choice, text, [], None, "error", None)

    def _record_round(
        self,
        plan: RoundPlan,
        result: RoundResult,
        plan_s: float,
        collect_s: float,
        update_s: float,
    ) -> None:
        out = result.out
        depth = int(plan.decode.num_draft.max(initial=0))
        positions = np.arange(depth)[:, None]  # [depth, 1]
        drafted = (out.num_drafted[None, :] > positions).sum(1).tolist()
        accepted = (np.minimum(out.num_accepted, out.num_drafted)[None, :] > positions).sum(1)
        t = result.timings
        switches = self.scheduler.num_policy_switches
        new_switches, self._num_switches = switches - self._num_switches, switches
        route = plan.route
        self._rounds.append(
            RoundStats(
                route=route,
                num_rows=result.num_rows,
                num_padded_rows=result.num_padded_rows,
                num_kv_tokens=result.num_kv_tokens,
                num_spec=route.count("S"),
                num_ar=route.count("A"),
                num_prefill=route.count("P"),
                predicted_s=plan.predicted_ms / 1e3,
                measured_s=t.total_ms / 1e3,
                phase_s={
                    "build": t.build_ms / 1e3,
                    "draft": t.draft_ms / 1e3,
                    "draft_wait": t.draft_wait_ms / 1e3,  # of it, waiting for the device
                    "catchup": t.catchup_ms / 1e3,  # of it, the drafter's catch-up (device)
                    "forward": t.forward_ms / 1e3,
                    "accept": t.accept_ms / 1e3,
                    "commit": t.commit_ms / 1e3,
                    "plan": plan_s,  # scheduler.plan on the host
                    # the previous round's outputs (detokenization, stop strings), overlapped
                    # with this round's device work
                    "collect": collect_s,
                    "update": update_s,  # scheduler.update on the host
                },
                drafted_per_pos=drafted,
                accepted_per_pos=accepted.tolist(),
                policy_switches=new_switches,
                reason=plan.reason,
                overlapped=result.overlapped,
                predicted_tokens=plan.predicted_tokens,
                num_emitted=int(out.token_starts[-1]),
            )
        )
        if len(self._rounds) > 4096:  # nobody drained the stats: keep memory bounded
            del self._rounds[:2048]

    def _collect(self, outputs, deltas: RoundDeltas | None) -> None:
        """A round's deltas into per-request outputs: text, stop strings, counters. A stop
        string ends the request in the scheduler at once (its tokens in flight are dropped)."""
        if deltas is None or not len(deltas):
            return
        req_ids = deltas.req_ids.tolist()
        starts = deltas.token_starts.tolist()
        token_ids = deltas.token_ids.tolist()
        num_drafted = deltas.num_drafted.tolist()
        num_accepted = deltas.num_accepted.tolist()
        finish = deltas.finish
        logprobs = deltas.logprobs
        choices = self._choices
        for i, req_id in enumerate(req_ids):
            choice = choices.get(req_id)
            if choice is None or choice.finished:
                continue  # aborted meanwhile, or ended by a stop string of an earlier round
            new = token_ids[starts[i] : starts[i + 1]]
            reason, stop_reason = finish.get(i, (None, None))
            lps = logprobs.get(i)
            step = choice.stream.push(new) if new else None
            text = step.text if step is not None else ""
            stopped = step is not None and step.stop is not None
            if stopped:
                keep = step.num_kept_ids
                new = new[:keep]
                lps = lps[:keep] if lps is not None else None
                reason, stop_reason = "stop", step.stop
                self.scheduler.stop(req_id, len(choice.token_ids) + keep, step.stop)
            choice.token_ids += new
            choice.num_drafted += num_drafted[i]
            choice.num_accepted += num_accepted[i]
            if reason is not None:
                choice.finished = True
                if not stopped:
                    text += choice.stream.finish().text
            self._emit(outputs, choice, text, new, lps, reason, stop_reason)

    def _emit(self, outputs, choice: _Choice, text, token_ids, logprobs, reason, stop_reason):
        """Adds to the choice's output of this step (one per choice and step)."""
        per_request = outputs.setdefault(choice.request_id, {})
        out = per_request.get(choice.index)
        if out is None:
            per_request[choice.index] = CompletionOutput(
                index=choice.index,
                text=text,
                token_ids=list(token_ids),
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=reason,
                stop_reason=stop_reason,
                num_draft_tokens=choice.num_drafted,
                num_accepted_tokens=choice.num_accepted,
            )
            return
        out.text += text
        out.token_ids += token_ids
        if logprobs is not None:
            out.logprobs = (out.logprobs or []) + list(logprobs)
        out.finish_reason, out.stop_reason = reason, stop_reason
        out.num_draft_tokens, out.num_accepted_tokens = choice.num_drafted, choice.num_accepted

    def _outputs(self, outputs: dict[str, dict[int, CompletionOutput]]) -> list[RequestOutput]:
        result = []
        for request_id, outs in outputs.items():
            req = self._requests.get(request_id)
            if req is None:
                continue
            result.append(
                RequestOutput(
                    request_id=request_id,
                    prompt=req.prompt,
                    prompt_token_ids=req.prompt_token_ids,
                    outputs=list(outs.values()),
                    finished=all(self._choices[c].finished for c in req.choice_ids),
                )
            )
        return result

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                for c in self._requests.pop(out.request_id).choice_ids:
                    del self._choices[c]
        return outputs

    # -- observability ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        rounds, self._rounds = self._rounds, []
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            slot_capacity=self.config.max_concurrency,
            live_slots=s.num_running,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=s.kv.num_free,
            rounds=rounds,
        )
