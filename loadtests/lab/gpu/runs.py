"""The engine side of `hipfire-bench gpu` (`loadtests/lab/gpu/main.py`): the refill loop on the
engine, one run's figures, the scheduler and drafter swapped in per run, and the grid of runs
under the time budget."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from loadtests.lab.gpu.mix import ANY, AR

if TYPE_CHECKING:
    from loadtests.lab.gpu.config import BenchConfig


# -- one run: driving the engine and summarising its steps ------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """One `Engine.step()`: its round (route "" when the step ran no request) and timings."""

    route: str  # one letter per request of the round: P, A or S
    num_rows: int
    # output tokens of the rounds the step finished (not the outputs the step returned: a
    # round's outputs reach the caller a step later when its successor was launched before
    # it finished, and a step that only launches returns the previous round's)
    num_tokens: int
    wall_s: float  # the whole step: plan, executor run, update, output collection
    predicted_s: float = 0.0  # the plan's predicted round time
    measured_s: float = 0.0  # the executor's run
    phase_s: dict[str, float] = field(default_factory=dict)
    num_accepted: int = 0  # accepted drafts of all speculating requests of the round
    predicted_tokens: float = 0.0  # tokens the plan expected the round to emit
    reason: str = ""  # the policy's reason for the round's route
    # per draft position j: the round's requests that drafted it, and that had it accepted
    # (the depths the policy chose, and how far their chains survived)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)


def mix(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total if total else 0.0 for k, v in counts.items()}


def summarize_steps(steps: Sequence[StepRecord], concurrency: int, run_s: float) -> dict:
    """A run's figures. Full-live steps: all `concurrency` requests in the round, none
    prefilling; each with the tokens of its round and its wall time, plus the wall time of the
    steps before it that finished no round (a step that launches an AR round ahead and returns
    at once: that round's time is split between the two steps). GPU idle bound: the share of
    full-live wall time outside the target forward and the drafter (host work the device waits
    for)."""
    rounds = [s for s in steps if s.route]
    full, full_s, carried = [], 0.0, 0.0
    for s in steps:
        if not s.route:
            carried += s.wall_s
            continue
        if len(s.route) == concurrency and "P" not in s.route:
            full.append(s)
            full_s += s.wall_s + carried
        carried = 0.0
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
    # full-live speculating request-rounds, their drafts and accepted drafts
    spec_full = sum(s.drafted_per_pos[0] for s in full if s.drafted_per_pos)
    drafts_full = sum(sum(s.drafted_per_pos) for s in full)
    accepted_full = sum(sum(s.accepted_per_pos) for s in full)
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
        # drafts per speculating request-round in full-live steps (the depths the policy
        # chose) and the share of them accepted
        "drafts_per_spec_full_live": drafts_full / spec_full if spec_full else None,
        "accepted_share_full_live": accepted_full / drafts_full if drafts_full else None,
        # tokens per speculating request-round (1 + accepted drafts), the simulator's measure
        "mean_accepted_len": (
            (letters["S"] + sum(s.num_accepted for s in rounds)) / letters["S"]
            if letters["S"]
            else None
        ),
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
        rounds = engine.stats().rounds  # the rounds the step finished (one, or none)
        rs = rounds[-1] if rounds else None
        steps.append(
            StepRecord(
                route=rs.route if rs else "",
                num_rows=rs.num_rows if rs else 0,
                num_tokens=sum(r.num_emitted for r in rounds),
                wall_s=wall_s,
                predicted_s=rs.predicted_s if rs else 0.0,
                measured_s=rs.measured_s if rs else 0.0,
                phase_s=dict(rs.phase_s) if rs else {},
                num_accepted=sum(rs.accepted_per_pos) if rs else 0,
                predicted_tokens=rs.predicted_tokens if rs else 0.0,
                reason=rs.reason if rs else "",
                drafted_per_pos=list(rs.drafted_per_pos) if rs else [],
                accepted_per_pos=list(rs.accepted_per_pos) if rs else [],
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

    lens = [len(s.prompt_token_ids) for _, s in make_requests(cfg.workload(concurrency), cfg.seed)]
    rng = np.random.default_rng([cfg.seed, concurrency])
    return [rng.integers(1, vocab, n).tolist() for n in lens]


# -- the engine and its swappable parts -----------------------------------------------------
def build_engine(cfg: BenchConfig):
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    longest = cfg.prompt_len * 3 // 2 + cfg.max_tokens
    # executor_bench.engine_loop: the prompt, the prefill of the last arrivals, the rounds
    idle_len = cfg.prompt_len + cfg.idle_rounds * 16 + 64
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
            drafter_follows_prefill=cfg.drafter_follows_prefill,
        )
    )


def chain_beside(engine, cfg: BenchConfig):
    """The draft model's drafter beside an engine built for the block drafter (None where the
    engine's own cost drafter is the draft model, or there is none): its model (random weights
    or a checkpoint, the target's dtype), its KV under the executor's block ids, bound to the
    executor's block table, its attention variants compiled. Its KV comes on top of the
    engine's `--kv-cache-memory`."""
    spec = cfg.chain_drafter
    if spec == "none" or spec == cfg.model_drafter:
        return None
    from executor.drafters.draft_model import DraftModelDrafter
    from executor.loader import load_model
    from executor.random_model import random_model

    ex, target = engine.executor, engine.target
    if spec.startswith("random:"):
        model = random_model(
            spec[len("random:") :],
            device=engine.device,
            dtype=target.dtype,
            seed=1,
            max_position=target.max_position,
        )
    else:
        model = load_model(spec, dtype=str(target.dtype).split(".")[-1], device=engine.device)
    drafter = DraftModelDrafter(
        model,
        num_blocks=engine.num_kv_blocks,
        block_size=ex.block_size,
        max_slots=ex.max_slots,
        max_model_len=ex.max_model_len,
        graphs="off" if ex.graphs is None else "lazy",
    )
    drafter.bind_block_tables(ex.table.block_tables)
    if engine.device.type == "cuda":
        from kernels.attention import compile_variants, verify_attention
        from scheduler.prefill_chunks import max_chunk_rows

        if model.ops.verify_attention is verify_attention:  # (not on torch reference ops)
            compile_variants(
                drafter.kv.k[0],
                drafter.kv.v[0],
                model.config.num_q_heads,
                max_seqs=ex.max_slots,
                max_q_len=max(max_chunk_rows(cfg.max_prefill_tokens), cfg.spec_depth),
                max_kv_len=ex.max_blocks_per_seq * ex.block_size,
            )
    return drafter


def cost_inners(engine, cfg: BenchConfig) -> dict:
    """Cost drafter name -> the real drafter with a model that runs for its cost: the engine's
    own (inside its synthetic drafter) and the draft model built beside a block drafter."""
    inners = {}
    own = getattr(engine.drafter, "inner", None)
    if own is not None and cfg.model_drafter != "none":
        inners[cfg.model_drafter] = own
    beside = chain_beside(engine, cfg)
    if beside is not None:
        inners[cfg.chain_drafter] = beside
    return inners


def cost_inner(drafter: str, model_inner):
    """The real drafter a synthetic drafter runs for its cost; `model_inner`: the drafter of
    the engine's draft model, or a dict of them by name (`cost_inners`)."""
    if drafter == "ngram":
        from executor.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if drafter == "none":
        return None
    return model_inner.get(drafter) if isinstance(model_inner, dict) else model_inner


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


def install(
    engine,
    cfg: BenchConfig,
    concurrency: int,
    policy: str,
    profile_path: str,
    drafter,
    acceptance=None,
):
    """Swaps a fresh scheduler (policy, slot capacity, a new cost model from the profile) and
    a synthetic drafter into the engine in place, so that models, KV cache and captured graphs
    are reused across runs. Called between runs only, when the engine is idle. `acceptance`:
    what an earlier run's scheduler learned of the drafter, adopted by the new one."""
    from scheduler.cost_model import CostModel
    from scheduler.scheduler import Scheduler, SchedulerConfig

    # the all-AR baseline is a server without speculation: its drafter follows no prefill
    follows = cfg.drafter_follows_prefill if policy != AR else "off"

    ec = engine.config
    engine.install_drafter(drafter, follows != "off")
    scheduler = Scheduler(
        SchedulerConfig(
            max_concurrency=concurrency,
            max_queue=ec.max_queue,
            spec_mode={AR: "ar", "all-spec": "spec"}.get(policy, "adaptive"),
            spec_depth=ec.spec_depth,
            block_size=ec.block_size,
            max_prefill_tokens=ec.max_prefill_tokens,
            max_model_len=engine.max_model_len,
            has_drafter=True,
            draft_kv_lookahead=int(getattr(drafter, "kv_lookahead", 0)),
            drafter_follows_prefill=(
                follows if getattr(drafter, "follows_prefill", False) else "off"
            ),
        ),
        num_kv_blocks=engine.num_kv_blocks,
        cost_model=CostModel.from_file(profile_path),
        policy=make_policy(policy, profile_path, cfg, drafter.cohort),
    )
    if acceptance is not None:
        scheduler.adopt_acceptance(acceptance)
    engine.install_scheduler(scheduler)


def warm_graphs(engine, cfg: BenchConfig, model_inners: dict | None = None) -> int:
    """Captures the decode graphs the runs will replay (row buckets of the profile x block-table
    widths of the workload's contexts x rows per sequence), so no capture lands inside a
    measured round, and the cost drafters' own (the engine's and `model_inners`'). Returns the
    number captured."""
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
    max_c = max(cfg.concurrency)
    for q in q_lens:
        # rounds whose longest group has q rows have at most max(C) * q rows; the cost model
        # pads them to the first profiled row count that holds them
        top = next((b for b in buckets if b >= max_c * q), buckets[-1] if buckets else 0)
        for bucket in buckets:
            if q <= bucket <= top:
                for width in widths:
                    graphs.capture(bucket, width, q)
    captured = len(graphs.graphs) - before
    drafter = getattr(engine, "drafter", None)
    inners = [getattr(drafter, "inner", drafter), *(model_inners or {}).values()]
    blocks = tuple(range(lo, hi + 1))
    for model_drafter in {id(d): d for d in inners if d is not None}.values():
        # the draft model's chain steps replay graphs of their own (one row per request)
        if hasattr(model_drafter, "capture_graphs"):
            drafts_before = model_drafter.num_graphs
            captured += (
                model_drafter.capture_graphs(
                    max_c, widths=blocks, max_wide_rows=cfg.max_prefill_tokens
                )
                - drafts_before
            )
        # a block drafter's blocks too: block_size rows per request, up to max(C) of them
        block_graphs = getattr(model_drafter, "graphs", None)
        if hasattr(model_drafter, "extend_context") and block_graphs is not None:
            from executor.graphs import bucket_for

            q = model_drafter.block_len
            top = -(-(cfg.prompt_len * 3 // 2 + cfg.max_tokens + q) // bs)  # a block past it
            block_widths = sorted({block_graphs.width_for(b) for b in range(lo, top + 1)})
            rows = sorted({bucket_for(q * k) for k in range(1, max_c + 1)} - {0})
            drafts_before = len(block_graphs.graphs)
            for bucket in rows:
                if bucket <= block_graphs.max_rows:
                    for width in block_widths:
                        block_graphs.capture(bucket, width, 1 << (q - 1).bit_length())
            captured += len(block_graphs.graphs) - drafts_before
    return captured


def _model_drafter_graphs(model_inner) -> int:
    """Decode graphs the cost drafter's model holds (0 without one)."""
    return getattr(model_inner, "num_graphs", 0)


def run_point(
    engine,
    cfg,
    policy,
    drafter,
    cohort,
    concurrency,
    paths,
    model_inner,
    compiles=None,
    acceptance=None,
) -> dict:
    """One run. `compiles` (a `loadtests.lab.compile_log.CompileLog`, installed): the Triton
    compilations made during the run are recorded with it. `acceptance`: what the scheduler
    starts from (`install`); the summary's `acceptance_carried` says whether it had any."""
    from executor.drafters.synthetic import SyntheticDrafter
    from hipfire_serve.types import SamplingParams

    synth = SyntheticDrafter(
        cfg.acceptance,
        cohort if cohort != ANY else cfg.points()[0][1],
        cfg.seed,
        inner=cost_inner(drafter, model_inner) if drafter != ANY else None,
    )
    install(engine, cfg, concurrency, policy, paths[drafter], synth, acceptance)
    graphs = engine.executor.graphs
    num_graphs = len(graphs.graphs) if graphs is not None else 0
    num_draft_graphs = _model_drafter_graphs(model_inner)
    compile_mark = compiles.mark() if compiles is not None else 0
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
        acceptance_carried=acceptance is not None,
        graphs_captured=(len(graphs.graphs) if graphs is not None else 0) - num_graphs,
        draft_graphs_captured=_model_drafter_graphs(model_inner) - num_draft_graphs,
        # Triton compilations during the run (a first use costs seconds inside a round)
        compiles=compiles.since(compile_mark) if compiles is not None else None,
        # (predicted ms, measured ms, speculating?) of every stride-th round, for the scatter
        pred_vs_meas=[
            [round(s.predicted_s * 1e3, 4), round(s.measured_s * 1e3, 4), "S" in s.route]
            for s in rounds[::stride]
        ],
    )
    if cfg.keep_rounds:
        summary["steps"] = [dataclasses.asdict(s) for s in steps]
    return summary


def warm_runs(engine, cfg, paths, model_inner) -> int:
    """Unmeasured all-spec runs of the first (drafter, cohort) at the largest and a small C
    before the grid (and of a draft model built beside a block drafter at a small C): kernels
    compiled on first use (the eager prefill chunks, the draft model's catch-up shapes) would
    otherwise stall the first measured run that meets them. Returns how many runs were made
    (none without a GPU)."""
    if engine.device.type != "cuda":
        return 0
    drafter, cohort = cfg.points()[0]
    sizes = sorted({max(cfg.concurrency), min(4, max(cfg.concurrency))}, reverse=True)
    for c in sizes:
        run_point(engine, cfg, "all-spec", drafter, cohort, c, paths, model_inner)
    # a draft model built beside the engine's block drafter: its first shapes too
    beside = [(d, co) for d, co in cfg.points() if d == cfg.chain_drafter != cfg.model_drafter]
    for d, co in beside[:1]:
        c = min(4, max(cfg.concurrency_of(d)))
        run_point(engine, cfg, "all-spec", d, co, c, paths, model_inner)
    return len(sizes) + len(beside[:1])


def grid_order(cfg: BenchConfig) -> list[tuple[int, str, str, str, int]]:
    """(repeat, policy, drafter, cohort, C), repeat-major; all-AR once per (repeat, C)."""
    order = []
    for rep in range(cfg.repeats):
        seen_ar: set[int] = set()
        for drafter, cohort in cfg.points():
            for c in cfg.concurrency_of(drafter):
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
    same C, else the largest smaller C scaled by the ratio of the Cs (the prefill work of a
    run grows about linearly with C)."""
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


def recover(engine, max_steps: int = 1000) -> bool:
    """Aborts whatever a failed run left in the engine and drains it; False if it cannot."""
    try:
        for request_id in engine.request_ids():
            engine.abort(request_id)
        for _ in range(max_steps):
            if not engine.has_unfinished():
                return True
            engine.step()
    except Exception:
        return False
    return not engine.has_unfinished()


def run_grid(
    engine, cfg, paths, model_inner, deadline: float, log, compiles=None
) -> tuple[list, list]:
    """Runs the grid in order; a run that would pass the deadline is skipped, one that raises
    is recorded and the engine recovered, so one bad point does not lose the others. Unless
    `cfg.cold_estimator`, a run starts from what the last finished run of its (repeat, policy,
    drafter, cohort) learned of the drafter: in grid order, the concurrency before it."""
    runs, skipped = [], []
    learned: dict[tuple, object] = {}  # (repeat, policy, drafter, cohort) -> knowledge
    durations: dict[tuple[str, int], float] = {}
    broken = False
    for rep, policy, drafter, cohort, c in grid_order(cfg):
        key = (rep, policy, drafter, cohort, c)
        point = dict(zip(("repeat", "policy", "drafter", "cohort", "concurrency"), key))
        kind = "ar" if policy == AR else "spec"
        if broken or time.perf_counter() + estimate_s(durations, policy, c) > deadline:
            skipped.append({**point, "reason": "engine unusable" if broken else "time budget"})
            continue
        t0 = time.perf_counter()
        try:
            known = None if cfg.cold_estimator else learned.get(key[:4])
            run = run_point(
                engine, cfg, policy, drafter, cohort, c, paths, model_inner, compiles, known
            )
            learned[key[:4]] = engine.scheduler.acceptance_knowledge()
        except Exception as e:
            log(f"  rep {rep} {policy} {drafter} {cohort} C={c} failed: {e!r}")
            skipped.append({**point, "reason": f"failed: {e!r}"[:300]})
            broken = not recover(engine)
            continue
        run["repeat"] = rep
        durations[(kind, c)] = max(durations.get((kind, c), 0.0), time.perf_counter() - t0)
        runs.append(run)
        # The runs' step records are the heap's growth: frozen between runs, they stay out of
        # the collector's full passes inside later runs' rounds (~430k such objects took a
        # 134 ms pass on a CPU). The H200 record of 2026-11-30 15:30 UTC, with this, still had
        # rounds at 2-7x their price: rounds with a prompt's short last chunk, not collections.
        engine.freeze_heap()
        full = run["full_live_tok_s"]
        if run["num_failed"]:
            log(f"  {run['num_failed']} requests failed in this run (see the engine's log)")
        log(
            f"  rep {rep} {policy:<9} {drafter:<18} {cohort:<6} C={c:<4} "
            f"full-live {(f'{full:,.0f}' if full else '-'):>9} tok/s  refill "
            f"{run['refill_tok_s']:,.0f} tok/s  ({run['run_s']:.1f} s)"
        )
    return runs, skipped
