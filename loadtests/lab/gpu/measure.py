"""Measurements of `hipfire-bench gpu` beside the runs (`loadtests/lab/gpu/main.py`): the cost
profile of the engine, round time against the roofline, GPU idle in the engine loop, and the
same workloads through the simulator."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtests.lab.gpu.mix import ANY, AR, mean_mix
from loadtests.lab.gpu.runs import cost_inner, install, make_prompts

if TYPE_CHECKING:
    from loadtests.lab.gpu.config import BenchConfig


# -- measurements -------------------------------------------------------------------------
def measure_profile(
    engine, cfg: BenchConfig, tmp: Path, model_inner=None
) -> tuple[dict, dict[str, str]]:
    """The cost profile of this engine and, per cost drafter, a profile file for the cost model
    (a drafter without a model costs no device time in the cost model; prompt lookup costs its
    measured host time, `drafter_host`). The engine's profile is its own cost drafter's (the
    block drafter's where there is one); a draft model built beside it (`model_inner`, a dict
    by name, `runs.cost_inners`) gets the same target terms, less the block drafter's context
    write, and its own `draft_model` section and speculating terms."""
    from executor.drafters.synthetic import SyntheticDrafter
    from executor.profiling.drafts import host_drafter_profile
    from hipfire_serve.cost_profile.blocks import target_only
    from hipfire_serve.cost_profile.build import build_profile, draft_model_section
    from hipfire_serve.cost_profile.engine_steps import drafter_spec_terms, time_spec_round_ratio

    profile = build_profile(engine, cfg.profile_rows, cfg.profile_kv_lens, cfg.profile_repeats)
    base = target_only(profile)  # the target's terms, for the other cost drafters
    ref = profile["target"].get("ref_kv_len") or cfg.prompt_len
    paths = {}
    by_drafter = {}
    ratio = profile["target"].get("spec_round_ratio")
    if ratio and cfg.model_drafter != "none":
        # beside the profile's factor (uneven contexts, as the runs' prompts are): equal ones
        by_drafter[cfg.model_drafter] = {
            "spec_round_ratio_even": time_spec_round_ratio(
                engine, profile, tuple(c for c, _ in ratio), ref, ragged=False
            )
        }
    for i, drafter in enumerate(cfg.drafters):
        p = profile if drafter == cfg.model_drafter else dict(base)
        inner = cost_inner(drafter, model_inner) if drafter != cfg.model_drafter else None
        if drafter == "ngram":  # prompt lookup: host time in every speculating round
            p["drafter_host"] = host_drafter_profile(
                cost_inner(drafter, None),
                tuple(c for c in cfg.concurrency),
                cfg.profile_repeats,
                ref,
                engine.target.config.vocab_size,
            )
        elif inner is not None and getattr(inner, "model", None) is not None:
            # the draft model beside the block drafter: its own proposals and catch-ups
            rows = tuple(r for r in cfg.profile_rows if r <= engine.executor.max_slots)
            p["draft_model"] = draft_model_section(
                engine, inner.model, inner, rows, ref, cfg.profile_repeats
            )
        if drafter != cfg.model_drafter and inner is not None:
            # the host time and pace of its own speculating rounds, measured with it as the
            # runs pay them (priced with the draft model's, the simulator put `ngram` 10-24%
            # below the runs in the 2026-11-30 12:35 record)
            cohort = next(co for d, co in cfg.points() if d == drafter)
            synth = SyntheticDrafter(cfg.acceptance, cohort, cfg.seed, inner=inner)
            terms = drafter_spec_terms(engine, p, synth, even=True)
            even = terms.pop("spec_round_ratio_even")
            p["target"] = {**p["target"], **terms}
            by_drafter[drafter] = {
                **terms,
                "spec_round_ratio_even": even,
                "drafter_host": p.get("drafter_host"),
            }
            if "draft_model" in p:
                by_drafter[drafter]["draft_model"] = p["draft_model"]
        paths[drafter] = str(tmp / f"profile-{i}.json")
        Path(paths[drafter]).write_text(json.dumps(p))
    paths[ANY] = paths[cfg.drafters[0]]
    # per drafter: a model-free drafter's own speculating terms (the record's profile holds
    # the engine's cost drafter's), and each drafter's round factor on equal contexts
    if by_drafter:
        profile = {**profile, "by_drafter": by_drafter}
    return profile, paths


def roofline_curve(engine, profile: dict) -> list[dict]:
    """Every shape of the profile's grid next to its roofline (AR rows up to the slot count,
    speculative groups past it, as the profiler builds them)."""
    from loadtests.lab.executor_bench import roofline_ms

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


def add_round_phases(
    engine, cfg: BenchConfig, curve: list[dict], deadline: float, bound: float = 1.3
) -> int:
    """Where a shape misses `bound` x its roofline, times it again phase by phase (host build,
    target forward, acceptance, commit: median ms) so the report can say where the time goes;
    until `deadline` (perf_counter seconds). Returns the number of shapes re-timed."""
    from executor.profiling.rounds import RoundTimer

    timer = RoundTimer(engine.executor, cfg.spec_depth)
    num = 0
    for r in curve:
        if time.perf_counter() > deadline:
            break
        if r["ratio"] is not None and r["ratio"] > bound:
            timer.time_round(r["rows"], r["kv_len"], repeats=3)
            r["phases_ms"] = {k: round(v, 4) for k, v in timer.last_phases.items()}
            num += 1
    return num


def measure_idle(engine, cfg: BenchConfig, paths: dict, model_inner) -> dict:
    """GPU idle in the engine loop at `idle_concurrency` decoding requests (torch profiler):
    all-AR, and adaptive on the first cohort."""
    from executor.drafters.synthetic import SyntheticDrafter
    from loadtests.lab.executor_bench import engine_loop

    if engine.device.type != "cuda" or cfg.idle_rounds <= 0:
        return {}
    drafter, cohort = cfg.points()[0]
    out = {}
    for policy in (AR, "adaptive"):
        synth = SyntheticDrafter(
            cfg.acceptance, cohort, cfg.seed, inner=cost_inner(drafter, model_inner)
        )
        install(engine, cfg, cfg.idle_concurrency, policy, paths[drafter], synth)
        out[policy] = engine_loop(
            engine, cfg.idle_concurrency, cfg.prompt_len, cfg.idle_rounds, profile_idle=True
        )
    return out


# -- the simulator -------------------------------------------------------------------------
def sim_task(
    cfg: BenchConfig, profile_path, cohort: str, policy: str, c: int, sim_seed: int, trace_keys
) -> tuple:
    """The arguments of one simulator run (`_sim_task`) of `cfg`'s workload at C = `c`,
    replaying the engine run of seed `cfg.seed` (its workload and acceptance traces, keyed by
    `trace_keys`) under the simulator's own timing noise `sim_seed`."""
    return (
        profile_path,
        cfg.acceptance,
        cohort,
        policy,
        c,
        dataclasses.asdict(cfg.workload(c)),
        cfg.spec_depth,
        cfg.max_prefill_tokens,
        sim_seed,
        cfg.seed,
        tuple(trace_keys),
        cfg.drafter_follows_prefill,
    )


def _sim_task(task: tuple, known=None) -> dict:
    """One simulator run (module-level: runs in worker processes; imports no torch), its
    scheduler starting from `known` (an earlier run's "acceptance") when given."""
    from scheduler.cost_model import ProfileCost
    from scheduler.sim.acceptance_model import load_cohorts
    from scheduler.sim.runner import SimSetup, Workload, run_sim

    (profile_path, acceptance, cohort, policy, c, workload, spec_depth, max_prefill, seed,
     run_seed, trace_keys, follows_prefill) = task  # fmt: skip
    result = run_sim(
        ProfileCost.from_file(profile_path),
        load_cohorts(acceptance)[cohort],
        SimSetup(
            policy=policy,
            concurrency=c,
            spec_depth=spec_depth,
            seed=seed,
            max_prefill_tokens=max_prefill,
            decide_ahead=True,  # as the engine's loop does
            # the run's own workload and acceptance traces, under the simulator's noise
            workload_seed=run_seed,
            trace_seed=run_seed,
            trace_keys=trace_keys,
            drafter_follows_prefill=follows_prefill,
            acceptance=known,
        ),
        Workload(**workload),
    )
    return {
        "full_live_tok_s": result.full_live_tok_s,
        "refill_tok_s": result.refill_tok_s,
        "route_mix_full_live": result.route_mix_full_live,
        "route_mix": result.route_mix,
        "pred_error": result.mean_abs_pred_error,
        "mean_accepted_len": result.mean_accepted_len,
        "acceptance": result.acceptance,
    }


def _sim_chain(chain: tuple) -> list[dict]:
    """`_sim_task` over the tasks of `chain` = (tasks, carry) in order; with carry, each run
    starts from what the one before learned of the drafter, as the engine's runs do."""
    tasks, carry = chain
    out, known = [], None
    for task in tasks:
        out.append(_sim_task(task, known))
        known = out[-1]["acceptance"] if carry else None
    return out


def simulate(cfg: BenchConfig, paths: dict, vocab: int) -> dict[tuple, dict]:
    """Every point through the simulator with the measured profile, replaying the runs' own
    workload and acceptance traces (the synthetic drafter's, keyed by the runs' prompts:
    `make_prompts`, `trace_key`); `sim_seeds` seeds of the simulator's timing noise each, the
    figures their mean."""
    from scheduler.sim.acceptance_model import trace_key

    all_c = sorted({*cfg.concurrency, *cfg.other_concurrency})
    keys_at = {c: tuple(trace_key(p) for p in make_prompts(cfg, c, vocab)) for c in all_c}
    lines = [(AR, ANY, ANY)] if AR in cfg.sim_policies else []
    lines += [(p, d, co) for d, co in cfg.points() for p in cfg.sim_policies if p != AR]
    # one chain per (policy, drafter, cohort, seed) over the drafter's concurrencies in grid
    # order, as the engine's runs carry the estimator's knowledge (`run_grid`)
    chains = [
        (
            tuple(
                sim_task(
                    cfg,
                    paths[drafter],
                    cohort if cohort != ANY else cfg.points()[0][1],
                    policy,
                    c,
                    cfg.seed + s,
                    keys_at[c],
                )
                for c in cfg.concurrency_of(drafter)
            ),
            not cfg.cold_estimator,
        )
        for policy, drafter, cohort in lines
        for s in range(cfg.sim_seeds)
    ]
    workers = cfg.workers or min(os.cpu_count() or 1, 16)
    if workers == 1:
        chained = [_sim_chain(t) for t in chains]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the parent holds a CUDA context and torch threads, which fork must not copy
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            chained = list(pool.map(_sim_chain, chains))
    # results[i]: the sim_seeds runs of keys[i] = (policy, drafter, cohort, C)
    keys, results = [], []
    for li, line in enumerate(lines):
        for ci, c in enumerate(cfg.concurrency_of(line[1])):
            keys.append((*line, c))
            results += [chained[li * cfg.sim_seeds + s][ci] for s in range(cfg.sim_seeds)]
    out = {}
    for i, key in enumerate(keys):
        seeds = results[i * cfg.sim_seeds : (i + 1) * cfg.sim_seeds]
        full = [r["full_live_tok_s"] for r in seeds if r["full_live_tok_s"] is not None]
        out[key] = {
            "full_live_tok_s": float(np.mean(full)) if len(full) == len(seeds) else None,
            "refill_tok_s": float(np.mean([r["refill_tok_s"] for r in seeds])),
            "route_mix_full_live": mean_mix([r["route_mix_full_live"] for r in seeds]),
            "mean_accepted_len": _mean_or_none([r["mean_accepted_len"] for r in seeds]),
            "pred_error": float(np.mean([r["pred_error"] for r in seeds])),
        }
    return out


def _mean_or_none(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None
