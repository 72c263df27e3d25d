"""Discrete-event simulation: the real Scheduler against the simulated executor.

Time advances by each round's simulated duration. Workloads:
- refill: closed loop; C requests start together (a wave) and each finished request is replaced
  at once while the source has requests, then the last ones drain;
- poisson: open loop; requests arrive at exponential gaps of mean 1/rate and wait when the
  slots are full.
Prompt lengths, arrival times and tenants come from the seed alone, so every policy sees the
same workload.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from scheduler.acceptance import AcceptanceKnowledge
from scheduler.cost_model import CostModel, ProfileCost
from scheduler.kv_blocks import num_blocks_for
from scheduler.plan import SamplingSpec
from scheduler.request import RequestSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.acceptance_model import AcceptanceClass
from scheduler.sim.baselines import make_policy
from scheduler.sim.executor import SimExecutor
from scheduler.tenants import TenantSpec, jain_index


@dataclass(frozen=True)
class Workload:
    kind: str = "refill"  # refill | poisson
    num_requests: int = 64
    prompt_len: int = 128  # mean; each prompt is uniform in [prompt_len / 2, 3 * prompt_len / 2]
    max_tokens: int = 256
    arrival_rate: float = 0.0  # requests per second (poisson)
    tenant_mix: tuple[tuple[str, float], ...] = ()  # (tenant, share of the requests)


@dataclass(frozen=True)
class RefillBench:
    """The GPU benchmark's refill workload (`hipfire-serve bench`), which the simulator checks
    run as well: C slots, max(waves x C, min_requests) requests, prompts uniform around
    `prompt_len`, `max_tokens` outputs, at `spec_depth` and `max_prefill_tokens` per round."""

    prompt_len: int = 1024
    max_tokens: int = 128
    waves: int = 2
    min_requests: int = 4
    spec_depth: int = 8
    max_prefill_tokens: int = 2048

    def num_requests(self, concurrency: int) -> int:
        return max(self.waves * concurrency, self.min_requests)

    def workload(self, concurrency: int) -> Workload:
        return Workload(
            kind="refill",
            num_requests=self.num_requests(concurrency),
            prompt_len=self.prompt_len,
            max_tokens=self.max_tokens,
        )


@dataclass(frozen=True)
class SimSetup:
    policy: str
    concurrency: int
    spec_depth: int = 8
    seed: int = 0
    noise_sigma: float = 0.03
    block_size: int = 16
    max_prefill_tokens: int = 2048
    num_kv_blocks: int = 0  # 0: enough for every slot at its longest (no preemption)
    tenants: tuple[TenantSpec, ...] = ()
    # decide the next round while this one "runs", as the engine does in its overlap window
    # (Scheduler.prepare_decision): decisions then see estimates one round older
    decide_ahead: bool = False
    # To replay a benchmark's run (its workload and its acceptance traces) under the simulator's
    # own timing noise (`seed`): the workload's seed (None: `seed`), the traces' seed (None:
    # `seed`) and one trace key per request index (empty: the request id), e.g. `trace_key` of
    # the run's prompts (`acceptance_model.AcceptanceState`)
    workload_seed: int | None = None
    trace_seed: int | None = None
    trace_keys: tuple[int, ...] = ()
    # the drafter computes prefill chunks alongside the target (no catch-up on the prompt)
    drafter_follows_prefill: str = "off"  # off | on | auto (SchedulerConfig)
    # what an earlier run's estimator learned of the drafter (its SimResult.acceptance), to
    # start from instead of the configured prior (Scheduler.adopt_acceptance); None: cold
    acceptance: AcceptanceKnowledge | None = None


@dataclass
class SimResult:
    policy: str
    concurrency: int
    full_live_tok_s: float | None  # rounds with all C slots decoding
    full_live_rounds: int
    refill_tok_s: float  # all tokens over the whole run, drain included
    mean_accepted_len: float | None  # tokens per speculating request-round (accepted + 1)
    mean_rows: float  # rows per round, all rounds
    mean_rows_full_live: float | None
    route_mix: dict[str, float]  # share of request-rounds per letter, all rounds
    route_mix_full_live: dict[str, float]
    num_rounds: int
    sim_seconds: float
    num_tokens: int
    mean_abs_pred_error: float  # |predicted - measured| / measured, rounds with work
    num_policy_switches: int
    num_preemptions: int
    latency_mean_s: float
    latency_p99_s: float
    tenant_slot_seconds: dict[str, float] = field(default_factory=dict)
    jain_index: float = 1.0
    wall_seconds: float = 0.0
    acceptance: AcceptanceKnowledge | None = None  # what the estimator knew at the end


def distinct_prompt(index: int, length: int) -> tuple[int, ...]:
    """Prompt `index` of a workload of unrelated prompts: its first two tokens differ from every
    other's (up to ~1M prompts), so the prefix cache finds nothing to share, as on traffic
    without common prefixes."""
    head = (2 + index % 997, 2 + index // 997 % 997)
    return (head + tuple(range(1000, 1000 + length - 2)))[:length]


def make_requests(workload: Workload, seed: int) -> list[tuple[float, RequestSpec]]:
    rng = np.random.default_rng(seed + 100)
    n = workload.num_requests
    lo, hi = max(workload.prompt_len // 2, 1), max(workload.prompt_len * 3 // 2, 1)
    prompt_lens = rng.integers(lo, hi + 1, size=n)
    if workload.kind == "poisson" and workload.arrival_rate > 0:
        arrivals = np.cumsum(rng.exponential(1.0 / workload.arrival_rate, size=n))
    else:
        arrivals = np.zeros(n)
    tenants = ["default"] * n
    if workload.tenant_mix:
        names = [t for t, _ in workload.tenant_mix]
        shares = np.array([s for _, s in workload.tenant_mix], dtype=np.float64)
        tenants = list(rng.choice(names, size=n, p=shares / shares.sum()))
    return [
        (
            float(arrivals[i]),
            RequestSpec(
                req_id=i,
                prompt_token_ids=distinct_prompt(i, int(prompt_lens[i])),
                sampling=SamplingSpec(),
                max_tokens=workload.max_tokens,
                tenant=str(tenants[i]),
                arrival_time=float(arrivals[i]),
            ),
        )
        for i in range(n)
    ]


def run_sim(
    profile: ProfileCost,
    classes: tuple[AcceptanceClass, ...],
    setup: SimSetup,
    workload: Workload,
    max_rounds: int = 1_000_000,
) -> SimResult:
    wall_start = time.perf_counter()
    c = setup.concurrency
    mode = {"all-ar": "ar", "all-spec": "spec"}.get(setup.policy, "adaptive")
    cfg = SchedulerConfig(
        max_concurrency=c,
        max_queue=max(workload.num_requests, 1),
        spec_mode=mode,
        spec_depth=setup.spec_depth,
        block_size=setup.block_size,
        max_prefill_tokens=setup.max_prefill_tokens,
        drafter_follows_prefill=setup.drafter_follows_prefill,
    )
    longest = workload.prompt_len * 3 // 2 + workload.max_tokens + setup.spec_depth
    num_blocks = setup.num_kv_blocks or c * num_blocks_for(longest, setup.block_size) + 1
    # the simulator-only policies' true cost: the drafter's prefill forward in every prefill
    # round when on
    drafter_prefill = cfg.drafter_follows_prefill == "on" and cfg.max_drafts > 0
    executor = SimExecutor(
        profile,
        classes,
        c,
        seed=setup.seed,
        noise_sigma=setup.noise_sigma,
        trace_seed=setup.trace_seed,
        trace_keys=setup.trace_keys,
    )
    policy = make_policy(
        setup.policy,
        profile=profile,
        executor=executor,
        max_drafts=setup.spec_depth - 1,
        mean_context=workload.prompt_len + workload.max_tokens // 2,
        drafter_prefill=drafter_prefill,
    )
    sched = Scheduler(cfg, num_blocks, CostModel(profile), setup.tenants, policy=policy)
    # policies told of rounds: sticky calibrates on each measured one; clairvoyant learns of the
    # round about to run while it decides the next (decide_ahead)
    observe_round = getattr(policy, "observe_round", None)
    announce = getattr(policy, "plan_in_flight", None)
    if setup.acceptance is not None:
        sched.adopt_acceptance(setup.acceptance)

    source = make_requests(
        workload, setup.seed if setup.workload_seed is None else setup.workload_seed
    )
    next_idx = 0
    arrival_of: dict[int, float] = {}
    now = 0.0

    def submit(spec: RequestSpec, at: float) -> None:
        arrival_of[spec.req_id] = at
        sched.add_request(spec)

    if workload.kind == "refill":
        while next_idx < min(c, len(source)):
            submit(source[next_idx][1], 0.0)
            next_idx += 1

    tokens_total = 0
    full_tokens = 0
    full_ms = 0.0
    full_rounds = 0
    full_rows = 0
    rows_total = 0
    letters_all = {"A": 0, "S": 0, "P": 0}
    letters_full = {"A": 0, "S": 0}
    spec_rounds = 0
    spec_tokens = 0
    pred_err = 0.0
    num_rounds = 0
    latencies: list[float] = []
    while num_rounds < max_rounds:
        if workload.kind == "poisson":
            while next_idx < len(source) and source[next_idx][0] <= now:
                submit(source[next_idx][1], source[next_idx][0])
                next_idx += 1
            if not sched.has_work():
                if next_idx >= len(source):
                    break
                now = source[next_idx][0]
                continue
        elif not sched.has_work():
            break
        plan = sched.plan(now)
        if setup.decide_ahead:
            if announce is not None:
                announce(plan)
            sched.prepare_decision()
        result = executor.run(plan)
        if not plan.num_reqs:
            sched.update(result, now)
            if not (plan.setup or plan.release):
                break  # nothing can run: a stuck workload (never expected)
            continue  # a release-only plan; the next one has work
        ms = result.timings.total_ms + executor.last_host_ms  # the round's period
        now += ms / 1e3
        deltas = sched.update(result, now)
        if observe_round is not None:
            observe_round(plan, ms)
        num_rounds += 1
        round_tokens = int(deltas.token_starts[-1])
        for i in sorted(deltas.finish):
            latencies.append(now - arrival_of[int(deltas.req_ids[i])])
            if workload.kind == "refill" and next_idx < len(source):
                submit(source[next_idx][1], now)
                next_idx += 1
        tokens_total += round_tokens
        rows_total += plan.num_rows
        pred_err += abs(plan.predicted_ms - ms) / ms
        num_spec = plan.route.count("S")
        num_dec = len(plan.decode)
        letters_all["P"] += len(plan.prefills)
        letters_all["S"] += num_spec
        letters_all["A"] += num_dec - num_spec
        spec = plan.decode.num_draft > 0
        spec_rounds += num_spec
        spec_tokens += num_spec + int(result.out.num_accepted[:num_dec][spec].sum())
        if plan.num_reqs == c and plan.is_decode_only:
            full_rounds += 1
            full_tokens += round_tokens
            full_ms += ms
            full_rows += plan.num_rows
            letters_full["S"] += num_spec
            letters_full["A"] += c - num_spec
    sched.kv.check()

    def mix(counts: dict[str, int]) -> dict[str, float]:
        total = sum(counts.values())
        return {k: (v / total if total else 0.0) for k, v in counts.items()}

    slot_seconds = sched.admission.slot_seconds()
    weights = {t.name: t.weight for t in setup.tenants}
    shares = [v / weights.get(name, 1.0) for name, v in slot_seconds.items() if v > 0]
    lat = np.array(latencies) if latencies else np.zeros(1)
    return SimResult(
        policy=setup.policy,
        concurrency=c,
        full_live_tok_s=full_tokens / (full_ms / 1e3) if full_rounds else None,
        full_live_rounds=full_rounds,
        refill_tok_s=tokens_total / now if now > 0 else 0.0,
        mean_accepted_len=spec_tokens / spec_rounds if spec_rounds else None,
        mean_rows=rows_total / max(num_rounds, 1),
        mean_rows_full_live=full_rows / full_rounds if full_rounds else None,
        route_mix=mix(letters_all),
        route_mix_full_live=mix(letters_full),
        num_rounds=num_rounds,
        sim_seconds=now,
        num_tokens=tokens_total,
        mean_abs_pred_error=pred_err / max(num_rounds, 1),
        num_policy_switches=sched.stats.num_policy_switches,
        num_preemptions=sched.stats.num_preemptions,
        latency_mean_s=float(lat.mean()),
        latency_p99_s=float(np.percentile(lat, 99)),
        tenant_slot_seconds=slot_seconds,
        jain_index=jain_index(shares),
        wall_seconds=time.perf_counter() - wall_start,
        acceptance=sched.acceptance_knowledge(),
    )
