"""Whole engine steps timed for the profile: the engine's host time around its rounds
(`time_engine_overhead`), the switch from speculating back to AR (`time_ar_restart`), and
speculating rounds as the engine runs them against the profile's price of them
(`time_spec_round_ratio`). Each runs greedy requests of random prompts on a throw-away scheduler
(`Engine.throwaway_scheduler`) and leaves the engine idle with its own scheduler."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from executor.profiling.device import sync_device
from hipfire_serve.round_stats import RoundStats
from hipfire_serve.types import SamplingParams
from scheduler.cost_model import ProfileCost
from scheduler.policy import AllARPolicy, AllSpecPolicy

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine


def host_points(max_slots: int) -> tuple[int, ...]:
    """Live request counts at which the engine's host time per round is measured."""
    return tuple(sorted({c for c in (1, 8, 32, max_slots) if c <= max_slots}))


def prompt_lens(c: int, prompt_len: int, ragged: bool) -> list[int]:
    """c prompt lengths of mean ~prompt_len: all equal, or (`ragged`) spread evenly over
    [prompt_len / 2, 3 prompt_len / 2]."""
    if not ragged or c < 2:
        return [prompt_len] * c
    lo = max(prompt_len // 2, 1)
    return [lo + round(i * (prompt_len * 3 // 2 - lo) / (c - 1)) for i in range(c)]


def run_engine_steps(
    engine: Engine,
    c: int,
    prompt_len: int,
    num_steps: int,
    spec_mode: str,
    ragged: bool = False,
    *,
    policy=None,
    every_step: bool = False,
) -> tuple[int, list[tuple[float, RoundStats | None]]]:
    """Up to `num_steps` decode steps of c greedy requests of `prompt_len` random tokens under
    a throw-away scheduler of `spec_mode` ("ar", "spec": every request drafts its full depth;
    `policy`: that policy instead), after their prefill and 3 settling steps; then aborts them
    and drains. `ragged`: prompt lengths spread evenly over [prompt_len / 2, 3 prompt_len / 2]
    instead (mean prompt_len), as a served batch's are. `every_step`: the steps that finish no
    round are kept too (with None for the round), and the device is not synchronised before a
    step, so rounds run ahead as in serving. -> (c as the KV cache and queue allow it,
    [(wall ms of `Engine.step`, the round's `RoundStats`)]), no steps when the model's context
    or the KV cache cannot keep requests decoding that long."""
    with engine.throwaway_scheduler(spec_mode, policy=policy):
        return _decode_steps(engine, c, prompt_len, num_steps, spec_mode, ragged, every_step)


def _decode_steps(engine, c, prompt_len, num_steps, spec_mode, ragged, every_step):
    """`run_engine_steps` on the scheduler in place."""
    longest = max(prompt_lens(2, prompt_len, ragged))
    # tokens a request may emit: every measured step can emit a whole draft chain
    max_tokens = (num_steps + 16) * (engine.config.spec_depth if spec_mode == "spec" else 1)
    max_tokens = min(max_tokens, engine.max_model_len - longest)
    if max_tokens < num_steps + 4:
        return c, []  # a context too short to keep requests decoding that long
    # as many requests as can wait and decode together in this engine's KV cache
    blocks_each = -(-(longest + max_tokens) // engine.config.block_size) + 1
    c = min(c, engine.scheduler.config.max_queue, engine.num_kv_blocks // blocks_each)
    if c < 1:
        return c, []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.target.config.vocab_size
    g = torch.Generator().manual_seed(c)
    ids = [f"profile-{spec_mode}-{c}-{i}" for i in range(c)]
    for req_id, n in zip(ids, prompt_lens(c, prompt_len, ragged)):
        prompt = torch.randint(1, vocab, (n,), generator=g).tolist()
        engine.add_request(req_id, prompt, params)
    steps = []
    try:
        while engine.scheduler.stats.num_prefilling or engine.scheduler.num_waiting:
            engine.step()
        for _ in range(3):  # settle: the first decode rounds may still capture graphs
            engine.step()
        engine.stats()  # (round records so far dropped: each step's record is its own)
        for _ in range(num_steps):
            if not engine.has_unfinished():
                break  # (speculating requests can run out of tokens first)
            if not every_step:
                sync_device(engine.device)
            t0 = time.perf_counter()
            engine.step()
            wall_ms = (time.perf_counter() - t0) * 1e3
            rounds = engine.stats().rounds
            if rounds or every_step:
                steps.append((wall_ms, rounds[-1] if rounds else None))
    finally:
        for req_id in ids:
            engine.abort(req_id)
        while engine.has_unfinished():
            engine.step()
    return c, steps


def time_engine_overhead(
    engine: Engine,
    concurrencies: tuple[int, ...],
    prompt_len: int = 64,
    num_steps: int = 12,
    spec_mode: str = "ar",
) -> list[list[float]]:
    """Per decode round, the engine's host time outside `RoundExecutor` (planning, the
    scheduler's update, output collection, bookkeeping) at each live request count: the wall
    time of `Engine.step` minus the executor's own round time, median of `num_steps`, in plain
    AR decode rounds (`spec_mode` "ar": run ahead, so mostly hidden) or speculating ones
    ("spec": every request drafts; nothing hides), each on a throw-away scheduler."""
    out = []
    for c in concurrencies:
        c, steps = run_engine_steps(engine, c, prompt_len, num_steps, spec_mode)
        overheads = [max(wall_ms - stats.measured_s * 1e3, 0.0) for wall_ms, stats in steps]
        if overheads and not any(p[0] == c for p in out):
            out.append([c, round(statistics.median(overheads), 4)])
    return out


class SwitchingPolicy:
    """Every request drafts its full depth for `spec_rounds` rounds, then `ar_rounds` rounds
    decode plainly, over and over (time_ar_restart's rounds)."""

    name = "switching"

    def __init__(self, spec_rounds: int, ar_rounds: int):
        self.period = spec_rounds + ar_rounds
        self.spec_rounds = spec_rounds
        self.num_decided = 0
        self._spec, self._ar = AllSpecPolicy(), AllARPolicy()

    def decide(self, view, estimator, cost_model):
        spec = self.num_decided % self.period < self.spec_rounds
        self.num_decided += 1
        return (self._spec if spec else self._ar).decide(view, estimator, cost_model)


def time_ar_restart(
    engine: Engine,
    concurrencies: tuple[int, ...],
    prompt_len: int = 64,
    num_cycles: int = 8,
    spec_rounds: int = 2,
    ar_rounds: int = 5,
) -> list[list[float]]:
    """What the switch from speculating back to AR costs, per live request count: the wall time
    of the first AR round after a speculating one over a steady AR round's, medians over
    `num_cycles` switches. AR rounds run ahead, one behind the other; the first after a
    speculating round starts from an idle pipeline, and the step that launches it finishes no
    round, so its wall time is counted with that round. Needs a drafter and rounds run ahead;
    -> [[c, ms], ...]"""
    if engine.drafter is None or not engine.config.overlap_rounds:
        return []
    out = []
    for c in concurrencies:
        _, steps = run_engine_steps(
            engine,
            c,
            prompt_len,
            num_cycles * (spec_rounds + ar_rounds),
            "spec",
            policy=SwitchingPolicy(spec_rounds, ar_rounds),
            every_step=True,
        )
        first, steady = [], []
        carried, prev = 0.0, ""
        for wall_ms, stats in steps:
            if stats is None:  # a step that launched a round ahead and finished none
                carried += wall_ms
                continue
            route = stats.route
            if "S" not in route and "P" not in route:  # an AR round
                if "S" in prev:
                    first.append(wall_ms + carried)
                elif not carried:
                    steady.append(wall_ms)
            carried, prev = 0.0, route
        if first and steady:
            restart = max(statistics.median(first) - statistics.median(steady), 0.0)
            out.append([c, round(restart, 4)])
    return out


def time_spec_round_ratio(
    engine: Engine,
    profile: dict,
    concurrencies: tuple[int, ...],
    context_len: int,
    num_steps: int = 24,
    ragged: bool = True,
) -> list[list[float]]:
    """Speculating rounds as the engine pays them against the profile's price of the same
    shapes: per speculating request count, the median over `num_steps` full-depth speculating
    rounds (every request drafting, prompts of `context_len` tokens on average, spread over
    half to 1.5 times it unless not `ragged`) of (the executor's measured round + the profile's
    host time around it) / the profile's price of the round. The profile's speculating terms
    are measured piece by piece (rounds alone, proposals alone, equal contexts); this is the
    factor that puts them together as the engine runs them, on contexts as uneven as a served
    batch's (the cost model prices a batch by its total context; uneven contexts cost more,
    docs/perf/context_probe.md). The price leaves out a factor `profile` already holds: the
    factor is against the terms alone. -> [[k, ratio], ...]"""
    terms = {k: v for k, v in profile["target"].items() if k != "spec_round_ratio"}
    cost = ProfileCost({**profile, "target": terms})
    out = []
    for c in concurrencies:
        ratios = []
        c, steps = run_engine_steps(engine, c, context_len, num_steps, "spec", ragged)
        for _, stats in steps:
            drafted = stats.drafted_per_pos
            depth = sum(1 for n in drafted if n > 0)
            k = stats.num_spec
            if not (k and depth) or stats.num_prefill:
                continue
            price = cost.round_ms_scalar(
                stats.num_rows, stats.num_kv_tokens, depth, k, num_draft_rows=int(sum(drafted))
            )
            host = cost.round_spec_host_ms(stats.num_rows, 0, k, depth, int(sum(drafted)))
            if price > 0:
                ratios.append((stats.measured_s * 1e3 + host) / price)
        if ratios and not any(p[0] == c for p in out):
            out.append([c, round(statistics.median(ratios), 4)])
    return out


def drafter_spec_terms(engine: Engine, profile: dict, drafter, even: bool = False) -> dict:
    """The profile's speculating terms that depend on the drafter, measured with `drafter` in
    the engine in place of its own (put back afterwards): `spec_host_ms_per_round` (the host
    time around its rounds) and then `spec_round_ratio` against `profile` priced with that host
    time (so `profile` should carry the drafter's own cost terms, e.g. `drafter_host`). A
    profile measured with a draft model prices a prompt-lookup drafter's rounds by these:
    verify rounds without a chain before them pay their host time and overlap differently. The
    engine is idle before and after. `even`: also the ratio on prompts of equal length
    ("spec_round_ratio_even"), what uneven contexts add shows against it.
    -> {"spec_host_ms_per_round": [...], "spec_round_ratio": [...]}"""
    ex = engine.executor
    saved = engine.drafter, ex.drafter_follows_prefill
    engine.install_drafter(drafter)
    try:
        points = host_points(ex.max_slots)
        host = time_engine_overhead(engine, points, spec_mode="spec")
        # (time_spec_round_ratio prices without a factor `profile` may hold)
        priced = {**profile, "target": {**profile["target"], "spec_host_ms_per_round": host}}
        ref = profile["target"].get("ref_kv_len") or 1024
        out = {"spec_host_ms_per_round": host}
        out["spec_round_ratio"] = time_spec_round_ratio(engine, priced, points, ref)
        if even:
            out["spec_round_ratio_even"] = time_spec_round_ratio(
                engine, priced, points, ref, ragged=False
            )
    finally:
        engine.install_drafter(*saved)
    return out
