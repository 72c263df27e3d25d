"""`hipfire-serve bench`: the end-to-end engine benchmark. Adaptive speculation against all-AR
and all-spec (and the simulator's other baselines) on real-shaped random-weight models, against
the roofline and against the simulator's prediction. Uses project internals (engine, scheduler,
executor, simulator); no HTTP.

    hipfire-serve bench --out OUT            # the GPU run: Qwen3-8B target, < 9 minutes
    hipfire-serve bench --quick --out OUT    # the same pipeline on `random:tiny` (CPU tests)

One run, in order:
1. one engine: the target, the `synthetic` drafter (acceptance from the shared acceptance models,
   cohorts code / prose / mixed) wrapping a real drafter whose cost every round pays (the
   Qwen3-0.6B-shaped draft model, or ngram);
2. the cost profile of that engine (`executor.profiler.build_profile`, copy bandwidth and bf16
   GEMM rate measured in the same call); the scheduler's cost model and the simulator read it;
3. round time over rows x KV length against the roofline max(bytes / copy BW, FLOPs / GEMM rate),
   and GPU idle in the engine loop at C = 64 (torch profiler);
4. the refill workload at each C: C slots, a finished request replaced at once while the source
   has requests, `waves * C` requests (at least `--min-requests`), prompts of ~`--prompt-len`
   tokens (uniform in [len/2, 3 len/2], the simulator's workload), `--max-tokens` outputs each,
   `ignore_eos`, greedy; per (policy, C, cohort, drafter), `--repeats` times. The engine's models,
   KV cache and captured graphs are reused: each run installs a fresh scheduler (the policy,
   with a fresh cost model) and a fresh synthetic drafter (so every policy sees the same
   acceptance traces); all-AR uses no drafter and runs once per C;
5. the same workloads through the simulator with the measured profile;
6. report: terminal table, `gpu.md`, `gpu.json` and PNG plots in `--out`.

Figures (the loadgen's definitions, on engine steps instead of streams): full-live tokens/s = the
tokens of the steps whose round ran all C requests decoding (route of C letters, no prefill)
over those steps' wall time; finite refill tokens/s = all tokens over the whole run, drain
included. `--time-budget-s` bounds the whole call: runs that would not fit are skipped (and
listed), repeat-major, so every point gets its first repeat before any gets a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtests.gpu_bench_report import mean_mix

PROFILES = Path(__file__).resolve().parents[1] / "scheduler" / "profiles"
AR = "all-ar"
ANY = "-"  # the cohort and drafter of all-AR points: AR uses neither
REAL_POLICIES = ("adaptive", "all-ar", "all-spec", "threshold", "goodput", "sticky", "survival")
SIM_POLICIES = (*REAL_POLICIES, "oracle")
# Fraction of the time budget kept for the simulator, the report and the plots.
RESERVE_FRACTION = 0.08


@dataclass(frozen=True)
class BenchConfig:
    model: str = "random:qwen3-8b"
    drafters: tuple[str, ...] = ("random:qwen3-0.6b", "ngram")  # cost drafters; <= 1 model
    cohorts: tuple[str, ...] = ("code", "prose", "mixed")  # for the first drafter
    other_cohorts: tuple[str, ...] = ("mixed",)  # for the drafters after the first
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    policies: tuple[str, ...] = ("adaptive", "all-ar", "all-spec")
    sim_policies: tuple[str, ...] = SIM_POLICIES
    prompt_len: int = 1024
    max_tokens: int = 128
    waves: int = 2
    min_requests: int = 4
    repeats: int = 2
    spec_depth: int = 8
    max_prefill_tokens: int = 2048
    profile_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    profile_kv_lens: tuple[int, ...] = (16, 512, 1024, 2048)
    profile_repeats: int = 6
    idle_concurrency: int = 64
    idle_rounds: int = 30
    time_budget_s: float = 500.0
    sim_seeds: int = 3
    kv_cache_memory: str = "72GiB"  # 1024 rows at 2048 tokens of KV fit the profile
    device: str = "auto"
    dtype: str = "bfloat16"
    seed: int = 0
    acceptance: str = str(PROFILES / "acceptance.json")
    keep_rounds: bool = False  # every step's record in the JSON (tests check the arithmetic)
    workers: int = 0  # simulator processes; 0: one per CPU (at most 16)

    def points(self) -> list[tuple[str, str]]:
        """(drafter, cohort) pairs of the speculative policies."""
        return [
            (d, c)
            for i, d in enumerate(self.drafters)
            for c in (self.other_cohorts if i else self.cohorts)
        ]

    @property
    def model_drafter(self) -> str:
        models = [d for d in self.drafters if d not in ("ngram", "none")]
        if len(models) > 1:
            raise ValueError(f"one draft model per run, got {', '.join(models)}")
        return models[0] if models else "none"

    def num_requests(self, concurrency: int) -> int:
        return max(self.waves * concurrency, self.min_requests)


QUICK = BenchConfig(
    model="random:tiny",
    drafters=("random:tiny", "ngram"),
    cohorts=("code",),
    other_cohorts=("code",),
    concurrency=(1, 2, 4),
    sim_policies=("adaptive", "all-ar", "all-spec", "oracle"),
    prompt_len=24,
    max_tokens=12,
    min_requests=2,
    profile_rows=(1, 2, 4, 8, 16, 32),
    profile_kv_lens=(16, 48),
    profile_repeats=1,
    idle_rounds=0,
    time_budget_s=120.0,
    sim_seeds=1,
    kv_cache_memory="64MiB",
    device="cpu",
    dtype="float32",
    keep_rounds=True,
    workers=1,
)


# -- one run: driving the engine and summarising its steps ------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """One `Engine.step()`: its round (route "" when the step ran no request) and timings."""

    route: str  # one letter per request of the round: P, A or S
    num_rows: int
    num_tokens: int  # output tokens the step returned
    wall_s: float  # the whole step: plan, executor run, update, output collection
    predicted_s: float = 0.0  # the plan's predicted round time
    measured_s: float = 0.0  # the executor's run
    phase_s: dict[str, float] = field(default_factory=dict)


def mix(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total if total else 0.0 for k, v in counts.items()}


def summarize_steps(steps: Sequence[StepRecord], concurrency: int, run_s: float) -> dict:
    """A run's figures. Full-live steps: all `concurrency` requests in the round, none
    prefilling. GPU idle bound: the share of full-live wall time outside the target forward
    and the drafter (host work the device waits for)."""
    rounds = [s for s in steps if s.route]
    full = [s for s in rounds if len(s.route) == concurrency and "P" not in s.route]
    full_s = sum(s.wall_s for s in full)
    letters = {"S": 0, "A": 0, "P": 0}
    letters_full = {"S": 0, "A": 0}
    for s in rounds:
        for letter in letters:
            letters[letter] += s.route.count(letter)
    for s in full:
        letters_full["S"] += s.route.count("S")
        letters_full["A"] += s.route.count("A")
    timed = [s for s in rounds if s.measured_s > 0 and s.predicted_s > 0]
    phases: dict[str, float] = {}
    for s in full:
        for name, sec in s.phase_s.items():
            phases[name] = phases.get(name, 0.0) + sec
    busy = phases.get("forward", 0.0) + phases.get("draft", 0.0)
    num_tokens = sum(s.num_tokens for s in steps)
    return {
        "num_tokens": num_tokens,
        "num_rounds": len(rounds),
        "run_s": run_s,
        "refill_tok_s": num_tokens / run_s if run_s > 0 else 0.0,
        "full_live_rounds": len(full),
        "full_live_s": full_s,
        "full_live_tokens": sum(s.num_tokens for s in full),
        "full_live_tok_s": sum(s.num_tokens for s in full) / full_s if full_s > 0 else None,
        "route_mix": mix(letters),
        "route_mix_full_live": mix(letters_full),
        "mean_rows_full_live": sum(s.num_rows for s in full) / len(full) if full else None,
        "pred_error": (
            float(np.mean([abs(s.predicted_s - s.measured_s) / s.measured_s for s in timed]))
            if timed
            else None
        ),
        "host_share_full_live": 1.0 - busy / full_s if full_s > 0 else None,
        "phase_ms_full_live": {k: v / len(full) * 1e3 for k, v in phases.items()} if full else {},
        "step_ms_full_live": full_s / len(full) * 1e3 if full else None,
    }


def drive_refill(engine, prompts: Sequence[list[int]], concurrency: int, params):
    """Closed loop on the engine: `concurrency` requests at once, each finished one replaced at
    once while prompts remain. Returns (step records, run seconds, requests that failed)."""
    pending = deque(enumerate(prompts))
    steps: list[StepRecord] = []
    num_failed = 0
    engine.stats()  # drop round records left by earlier use: each step's record is its own
    t_start = time.perf_counter()

    def submit() -> None:
        i, prompt = pending.popleft()
        engine.add_request(f"bench-{i}", prompt, params)

    for _ in range(min(concurrency, len(pending))):
        submit()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        wall_s = time.perf_counter() - t0
        num_tokens = sum(len(o.token_ids) for r in outputs for o in r.outputs)
        rounds = engine.stats().rounds
        rs = rounds[-1] if rounds else None
        steps.append(
            StepRecord(
                route=rs.route if rs else "",
                num_rows=rs.num_rows if rs else 0,
                num_tokens=num_tokens,
                wall_s=wall_s,
                predicted_s=rs.predicted_s if rs else 0.0,
                measured_s=rs.measured_s if rs else 0.0,
                phase_s=dict(rs.phase_s) if rs else {},
            )
        )
        for r in outputs:
            num_failed += sum(o.finish_reason == "error" for o in r.outputs)
            if r.finished and pending:
                submit()
    return steps, time.perf_counter() - t_start, num_failed


def make_prompts(cfg: BenchConfig, concurrency: int, vocab: int) -> list[list[int]]:
    """The simulator's prompt lengths for this workload, filled with seeded random ids: every
    policy at this C gets the same prompts (the synthetic traces are keyed by the prompt)."""
    from scheduler.sim.runner import make_requests

    lens = [
        len(s.prompt_token_ids) for _, s in make_requests(sim_workload(cfg, concurrency), cfg.seed)
    ]
    rng = np.random.default_rng([cfg.seed, concurrency])
    return [rng.integers(1, vocab, n).tolist() for n in lens]


def sim_workload(cfg: BenchConfig, concurrency: int):
    from scheduler.sim.runner import Workload

    return Workload(
        kind="refill",
        num_requests=cfg.num_requests(concurrency),
        prompt_len=cfg.prompt_len,
        max_tokens=cfg.max_tokens,
    )


# -- the engine and its swappable parts -----------------------------------------------------
def build_engine(cfg: BenchConfig):
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    longest = cfg.prompt_len * 3 // 2 + cfg.max_tokens
    idle_len = cfg.prompt_len + cfg.idle_rounds * 16 + 64  # executor_bench.gpu_idle_fraction
    return Engine(
        EngineConfig(
            model=cfg.model,
            draft="synthetic",
            allow_synthetic_draft=True,
            synthetic_cost_drafter=cfg.model_drafter,
            acceptance_profile=f"{cfg.acceptance}:{cfg.points()[0][1]}",
            spec_mode="adaptive",
            spec_depth=cfg.spec_depth,
            max_concurrency=max((*cfg.concurrency, cfg.idle_concurrency)),
            max_queue=max(cfg.num_requests(c) for c in cfg.concurrency) + 1,
            max_model_len=max(longest, idle_len) + cfg.spec_depth + 16,
            kv_cache_memory=cfg.kv_cache_memory,
            max_prefill_tokens=cfg.max_prefill_tokens,
            device=cfg.device,
            dtype=cfg.dtype,
            graphs="lazy",
            seed=cfg.seed,
        )
    )


def cost_inner(engine, drafter: str, model_inner):
    """The real drafter a synthetic drafter runs for its cost."""
    if drafter == "ngram":
        from executor.drafters.ngram import NgramDrafter

        return NgramDrafter()
    return None if drafter == "none" else model_inner


def make_policy(name: str, profile_path: str, cfg: BenchConfig, cohort: str):
    """The policy object for the baselines (None: the scheduler's own spec_mode policy)."""
    if name in ("adaptive", AR, "all-spec"):
        return None
    from scheduler.cost_model import ProfileCost
    from scheduler.sim import baselines
    from scheduler.sim.acceptance_model import load_cohorts

    profile = ProfileCost.from_file(profile_path)
    if name == "threshold":
        classes = load_cohorts(cfg.acceptance)[cohort]
        total = sum(c.weight for c in classes)
        mean_acc = sum(c.weight * c.mean_acceptance for c in classes) / total
        mean_context = cfg.prompt_len + cfg.max_tokens // 2
        return baselines.ThresholdPolicy(profile, mean_acc, cfg.spec_depth - 1, mean_context)
    if name == "goodput":
        return baselines.GoodputPolicy(profile)
    if name == "sticky":
        return baselines.StickyGatePolicy()
    if name == "survival":
        return baselines.SurvivalAdmissionPolicy(profile)
    raise ValueError(f"policy {name!r} cannot run on the engine (simulator only)")


def install(engine, cfg: BenchConfig, concurrency: int, policy: str, profile_path: str, drafter):
    """Swaps a fresh scheduler (policy, slot capacity, a new cost model from the profile) and
    a synthetic drafter into the engine in place, so that models, KV cache and captured graphs
    are reused across runs. Called between runs only, when the engine is idle."""
    from scheduler.cost_model import CostModel
    from scheduler.scheduler import Scheduler, SchedulerConfig

    assert not engine.has_unfinished()
    ec = engine.config
    engine.scheduler = Scheduler(
        SchedulerConfig(
            max_concurrency=concurrency,
            max_queue=ec.max_queue,
            spec_mode={AR: "ar", "all-spec": "spec"}.get(policy, "adaptive"),
            spec_depth=ec.spec_depth,
            block_size=ec.block_size,
            max_prefill_tokens=ec.max_prefill_tokens,
            max_model_len=engine.max_model_len,
            has_drafter=True,
        ),
        num_kv_blocks=engine.num_kv_blocks,
        cost_model=CostModel.from_file(profile_path),
        stop_checker=engine._check_stop_strings,
        policy=make_policy(policy, profile_path, cfg, drafter.cohort),
    )
    engine._num_switches = 0
    engine.drafter = engine.executor.drafter = drafter


def warm_graphs(engine, cfg: BenchConfig) -> int:
    """Captures the decode graphs the runs will replay (row buckets of the profile x block-table
    widths of the workload's contexts x rows per sequence), so no capture lands inside a
    measured round. Returns the number captured."""
    graphs = engine.executor.graphs
    if graphs is None:
        return 0
    bs = engine.config.block_size
    lo = -(-(cfg.prompt_len // 2) // bs)
    hi = -(-(cfg.prompt_len * 3 // 2 + cfg.max_tokens + cfg.spec_depth) // bs)
    widths = sorted({graphs.width_for(b) for b in range(lo, hi + 1)})
    q_lens = [1 << i for i in range(max(cfg.spec_depth - 1, 0).bit_length() + 1)]
    before = len(graphs.graphs)
    buckets = sorted(b for b in cfg.profile_rows if b <= graphs.max_rows)
    # all-AR rounds have at most max(C) rows: their bucket is the first profiled row count
    # that holds them
    ar_top = next((b for b in buckets if b >= max(cfg.concurrency)), buckets[-1] if buckets else 0)
    for bucket in buckets:
        for width in widths:
            for q in q_lens:
                if (q == 1 and bucket <= ar_top) or (1 < q <= bucket):
                    graphs.capture(bucket, width, q)
    return len(graphs.graphs) - before


# -- measurements -------------------------------------------------------------------------
def measure_profile(engine, cfg: BenchConfig, tmp: Path) -> tuple[dict, dict[str, str]]:
    """The cost profile of this engine and, per cost drafter, a profile file for the cost model
    (a drafter without a model costs no device time in the cost model)."""
    from executor.profiler import build_profile

    profile = build_profile(engine, cfg.profile_rows, cfg.profile_kv_lens, cfg.profile_repeats)
    paths = {}
    for i, drafter in enumerate(cfg.drafters):
        p = dict(profile)
        if drafter != cfg.model_drafter:
            p.pop("draft_model", None)
        paths[drafter] = str(tmp / f"profile-{i}.json")
        Path(paths[drafter]).write_text(json.dumps(p))
    paths[ANY] = paths[cfg.drafters[0]]
    return profile, paths


def roofline_curve(engine, profile: dict) -> list[dict]:
    """Every shape of the profile's grid next to its roofline (AR rows up to the slot count,
    speculative groups past it, as the profiler builds them)."""
    from loadtests.executor_bench import roofline_ms

    ceilings = profile.get("ceilings") or {}
    max_slots = engine.executor.max_slots
    out = []
    for rows, kv_len, ms in profile["target"]["rows_kv_ms"]:
        per_seq = 1 if rows <= max_slots else -(-rows // max_slots)
        num_seqs = -(-rows // per_seq)
        roof = roofline_ms(engine, rows, num_seqs * kv_len, ceilings) if ceilings else None
        out.append(
            {
                "rows": rows,
                "kv_len": kv_len,
                "seqs": num_seqs,
                "round_ms": ms,
                "roofline_ms": roof,
                "ratio": ms / roof if roof else None,
            }
        )
    return out


def measure_idle(engine, cfg: BenchConfig, paths: dict, model_inner) -> dict:
    """GPU idle in the engine loop at `idle_concurrency` decoding requests (torch profiler):
    all-AR, and adaptive on the first cohort."""
    from executor.drafters.synthetic import SyntheticDrafter
    from loadtests.executor_bench import gpu_idle_fraction

    if engine.device.type != "cuda" or cfg.idle_rounds <= 0:
        return {}
    drafter, cohort = cfg.points()[0]
    out = {}
    for policy in (AR, "adaptive"):
        synth = SyntheticDrafter(
            cfg.acceptance, cohort, cfg.seed, inner=cost_inner(engine, drafter, model_inner)
        )
        install(engine, cfg, cfg.idle_concurrency, policy, paths[drafter], synth)
        out[policy] = gpu_idle_fraction(
            engine, cfg.idle_concurrency, cfg.prompt_len, cfg.idle_rounds
        )
    return out


def run_point(engine, cfg, policy, drafter, cohort, concurrency, paths, model_inner) -> dict:
    from executor.drafters.synthetic import SyntheticDrafter
    from hipfire_serve.types import SamplingParams

    synth = SyntheticDrafter(
        cfg.acceptance,
        cohort if cohort != ANY else cfg.points()[0][1],
        cfg.seed,
        inner=cost_inner(engine, drafter, model_inner) if drafter != ANY else None,
    )
    install(engine, cfg, concurrency, policy, paths[drafter], synth)
    graphs = engine.executor.graphs
    num_graphs = len(graphs.graphs) if graphs is not None else 0
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(cfg, concurrency, engine.target.config.vocab_size)
    steps, run_s, num_failed = drive_refill(engine, prompts, concurrency, params)
    summary = summarize_steps(steps, concurrency, run_s)
    summary["num_failed"] = num_failed  # rounds that raised fail their requests (engine log)
    rounds = [s for s in steps if s.route and s.measured_s > 0]
    stride = max(1, len(rounds) // 150)
    summary.update(
        policy=policy,
        drafter=drafter,
        cohort=cohort,
        concurrency=concurrency,
        num_requests=len(prompts),
        graphs_captured=(len(graphs.graphs) if graphs is not None else 0) - num_graphs,
        # (predicted ms, measured ms, speculating?) of every stride-th round, for the scatter
        pred_vs_meas=[
            [round(s.predicted_s * 1e3, 4), round(s.measured_s * 1e3, 4), "S" in s.route]
            for s in rounds[::stride]
        ],
    )
    if cfg.keep_rounds:
        summary["steps"] = [dataclasses.asdict(s) for s in steps]
    return summary


def grid_order(cfg: BenchConfig) -> list[tuple[int, str, str, str, int]]:
    """(repeat, policy, drafter, cohort, C), repeat-major; all-AR once per (repeat, C)."""
    order = []
    for rep in range(cfg.repeats):
        seen_ar: set[int] = set()
        for drafter, cohort in cfg.points():
            for c in cfg.concurrency:
                for policy in cfg.policies:
                    if policy == AR:
                        if c not in seen_ar:
                            seen_ar.add(c)
                            order.append((rep, AR, ANY, ANY, c))
                    else:
                        order.append((rep, policy, drafter, cohort, c))
    return order


def estimate_s(durations: dict, policy: str, concurrency: int) -> float:
    """Expected seconds of a run from the ones done: the same (policy kind, C), else the
    same C, else twice the largest smaller C (prefill work grows about linearly with C)."""
    kind = "ar" if policy == AR else "spec"
    if (kind, concurrency) in durations:
        return durations[(kind, concurrency)]
    same_c = [v for (_, c), v in durations.items() if c == concurrency]
    if same_c:
        return max(same_c)
    smaller = [(c, v) for (_, c), v in durations.items() if c < concurrency]
    if smaller:
        c, v = max(smaller)
        return v * concurrency / c
    return 0.0


def run_grid(engine, cfg, paths, model_inner, deadline: float, log) -> tuple[list, list]:
    runs, skipped = [], []
    durations: dict[tuple[str, int], float] = {}
    for rep, policy, drafter, cohort, c in grid_order(cfg):
        key = (rep, policy, drafter, cohort, c)
        kind = "ar" if policy == AR else "spec"
        if time.perf_counter() + estimate_s(durations, policy, c) > deadline:
            skipped.append(dict(zip(("repeat", "policy", "drafter", "cohort", "concurrency"), key)))
            continue
        t0 = time.perf_counter()
        run = run_point(engine, cfg, policy, drafter, cohort, c, paths, model_inner)
        run["repeat"] = rep
        durations[(kind, c)] = max(durations.get((kind, c), 0.0), time.perf_counter() - t0)
        runs.append(run)
        full = run["full_live_tok_s"]
        if run["num_failed"]:
            log(f"  {run['num_failed']} requests failed in this run (see the engine's log)")
        log(
            f"  rep {rep} {policy:<9} {drafter:<18} {cohort:<6} C={c:<4} "
            f"full-live {(f'{full:,.0f}' if full else '-'):>9} tok/s  refill "
            f"{run['refill_tok_s']:,.0f} tok/s  ({run['run_s']:.1f} s)"
        )
    return runs, skipped


# -- the simulator -------------------------------------------------------------------------
def _sim_task(task: tuple) -> dict:
    """One simulator run (module-level: runs in worker processes; imports no torch)."""
    from scheduler.cost_model import ProfileCost
    from scheduler.sim.acceptance_model import load_cohorts
    from scheduler.sim.runner import SimSetup, Workload, run_sim

    profile_path, acceptance, cohort, policy, c, workload, spec_depth, max_prefill, seed = task
    result = run_sim(
        ProfileCost.from_file(profile_path),
        load_cohorts(acceptance)[cohort],
        SimSetup(
            policy=policy,
            concurrency=c,
            spec_depth=spec_depth,
            seed=seed,
            max_prefill_tokens=max_prefill,
        ),
        Workload(**workload),
    )
    return {
        "full_live_tok_s": result.full_live_tok_s,
        "refill_tok_s": result.refill_tok_s,
        "route_mix_full_live": result.route_mix_full_live,
        "route_mix": result.route_mix,
        "pred_error": result.mean_abs_pred_error,
    }


def simulate(cfg: BenchConfig, paths: dict) -> dict[tuple, dict]:
    """Every point through the simulator with the measured profile, `sim_seeds` seeds each
    (acceptance draws differ between seeds; the figures are their mean)."""
    keys = [(AR, ANY, ANY, c) for c in cfg.concurrency if AR in cfg.sim_policies]
    keys += [
        (p, d, co, c)
        for d, co in cfg.points()
        for c in cfg.concurrency
        for p in cfg.sim_policies
        if p != AR
    ]
    tasks = []
    for policy, drafter, cohort, c in keys:
        workload = dataclasses.asdict(sim_workload(cfg, c))
        for s in range(cfg.sim_seeds):
            tasks.append(
                (
                    paths[drafter],
                    cfg.acceptance,
                    cohort if cohort != ANY else cfg.points()[0][1],
                    policy,
                    c,
                    workload,
                    cfg.spec_depth,
                    cfg.max_prefill_tokens,
                    cfg.seed + s,
                )
            )
    workers = cfg.workers or min(os.cpu_count() or 1, 16)
    if workers == 1:
        results = [_sim_task(t) for t in tasks]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the parent holds a CUDA context and torch threads, which fork must not copy
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            results = list(pool.map(_sim_task, tasks, chunksize=4))
    out = {}
    for i, key in enumerate(keys):
        seeds = results[i * cfg.sim_seeds : (i + 1) * cfg.sim_seeds]
        full = [r["full_live_tok_s"] for r in seeds if r["full_live_tok_s"] is not None]
        out[key] = {
            "full_live_tok_s": float(np.mean(full)) if len(full) == len(seeds) else None,
            "refill_tok_s": float(np.mean([r["refill_tok_s"] for r in seeds])),
            "route_mix_full_live": mean_mix([r["route_mix_full_live"] for r in seeds]),
            "pred_error": float(np.mean([r["pred_error"] for r in seeds])),
        }
    return out


# -- command line ------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


# flag -> (BenchConfig field, parser); every flag defaults to the preset's value
FLAGS = {
    "--model": ("model", str),
    "--drafters": ("drafters", _names),
    "--cohorts": ("cohorts", _names),
    "--other-cohorts": ("other_cohorts", _names),
    "--concurrency": ("concurrency", _ints),
    "--policies": ("policies", _names),
    "--sim-policies": ("sim_policies", _names),
    "--prompt-len": ("prompt_len", int),
    "--max-tokens": ("max_tokens", int),
    "--waves": ("waves", int),
    "--min-requests": ("min_requests", int),
    "--repeats": ("repeats", int),
    "--spec-depth": ("spec_depth", int),
    "--max-prefill-tokens": ("max_prefill_tokens", int),
    "--profile-rows": ("profile_rows", _ints),
    "--profile-kv-lens": ("profile_kv_lens", _ints),
    "--profile-repeats": ("profile_repeats", int),
    "--idle-concurrency": ("idle_concurrency", int),
    "--idle-rounds": ("idle_rounds", int),
    "--time-budget-s": ("time_budget_s", float),
    "--sim-seeds": ("sim_seeds", int),
    "--kv-cache-memory": ("kv_cache_memory", str),
    "--device": ("device", str),
    "--dtype": ("dtype", str),
    "--seed": ("seed", int),
    "--acceptance": ("acceptance", str),
    "--workers": ("workers", int),
}
HELP = {
    "--drafters": "cost drafters, comma-separated: at most one draft model (random:NAME or a "
    "directory), 'ngram', 'none'",
    "--cohorts": "acceptance cohorts of the first drafter",
    "--other-cohorts": "acceptance cohorts of the drafters after the first",
    "--policies": f"run on the engine, from: {', '.join(REAL_POLICIES)}",
    "--sim-policies": f"run in the simulator, from: {', '.join(SIM_POLICIES)}",
    "--min-requests": "requests per run at least (else waves x C)",
    "--time-budget-s": "wall-clock bound of the whole call; runs that would not fit are skipped",
    "--sim-seeds": "simulator runs per point (their mean is the prediction)",
    "--workers": "simulator processes; 0: one per CPU, at most 16",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hipfire-serve bench", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("--quick", action="store_true", help="small CPU preset (random:tiny)")
    ap.add_argument("--out", required=True, help="folder for gpu.md, gpu.json and the plots")
    ap.add_argument("--keep-rounds", action="store_true", help="every step's record in the JSON")
    for flag, (name, _) in FLAGS.items():
        default = getattr(BenchConfig, name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        ap.add_argument(flag, default=None, help=f"{HELP.get(flag, name)} (default {shown})")
    return ap


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = QUICK if args.quick else BenchConfig()
    changes = {}
    for flag, (name, parse) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[name] = parse(value)
    if args.keep_rounds:
        changes["keep_rounds"] = True
    cfg = dataclasses.replace(cfg, **changes)
    unknown = [p for p in cfg.policies if p not in REAL_POLICIES]
    unknown += [p for p in cfg.sim_policies if p not in SIM_POLICIES]
    if unknown:
        raise ValueError(f"unknown or simulator-only policies: {', '.join(unknown)}")
    if not cfg.drafters or not cfg.concurrency or cfg.repeats < 1 or cfg.sim_seeds < 1:
        raise ValueError("need drafters, concurrency values, --repeats >= 1, --sim-seeds >= 1")
    if min(cfg.concurrency) < 1 or cfg.prompt_len < 2 or cfg.max_tokens < 1:
        raise ValueError("--concurrency >= 1, --prompt-len >= 2 and --max-tokens >= 1")
    cfg.model_drafter  # noqa: B018  (validates: at most one draft model)
    return cfg


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"hipfire-serve bench: {e}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    import torch

    from loadtests import gpu_bench_report as report

    deadline = t_start + cfg.time_budget_s * (1.0 - RESERVE_FRACTION)
    try:
        engine = build_engine(cfg)
    except (ValueError, OSError) as e:
        print(f"hipfire-serve bench: {e}", file=sys.stderr)
        return 2
    model_inner = getattr(engine.drafter, "inner", None)
    device = engine.device
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"engine ready on {dev_name}: {cfg.model}, cost drafters {', '.join(cfg.drafters)}")
    with tempfile.TemporaryDirectory() as tmp:
        profile, paths = measure_profile(engine, cfg, Path(tmp))
        log(f"profile measured: ceilings {profile.get('ceilings') or 'none (no GPU)'}")
        roofline = roofline_curve(engine, profile)
        num_graphs = warm_graphs(engine, cfg)
        log(f"{num_graphs} decode graphs captured ahead of the runs")
        idle = measure_idle(engine, cfg, paths, model_inner)
        if idle:
            fractions = {k: round(v["gpu_idle_fraction"], 3) for k, v in idle.items()}
            log(f"GPU idle at C={cfg.idle_concurrency}: {fractions}")
        runs, skipped = run_grid(engine, cfg, paths, model_inner, deadline, log)
        log(f"{len(runs)} runs done, {len(skipped)} skipped; simulating")
        sims = simulate(cfg, paths)
    summary = report.summarize(runs, sims)
    comparisons = report.compare_policies(summary, cfg.points(), cfg.concurrency)
    targets = report.check_targets(comparisons, summary, roofline, idle)
    config = dataclasses.asdict(cfg)
    config["points"] = cfg.points()
    record = {
        "device": dev_name,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "config": config,
        "profile": profile,
        "roofline": roofline,
        "idle": idle,
        "targets": targets,
        "comparisons": comparisons,
        "summary": summary,
        "runs": runs,
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - t_start,
    }
    print(report.comparison_table(comparisons))
    for key in (
        "adaptive_vs_best",
        "adaptive_at_crossover",
        "roofline",
        "gpu_idle_c64",
        "simulator",
    ):
        t = targets[key]
        worst = "-" if t["worst"] is None else f"{t['worst']:.3f}"
        print(f"target {key}: {t['status']} (worst {worst}, bound {t['bound']})")
    paths_out = report.write_outputs(record, Path(args.out))
    log(f"wrote {', '.join(p.name for p in paths_out)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
