"""Does the engine decide like the simulator? The real `Engine` (scheduler, policy, executor,
on a CPU with a tiny random model) runs the GPU benchmark's refill workload with the
`synthetic` drafter, but every round's measured time is replaced by what a cost profile prices
it at (times lognormal noise): the policy then sees the device the profile describes. The same
workload runs through the simulator with the same profile; the share of decoding
request-rounds that speculate is compared.

    hipfire-bench replay --profile docs/perf/gpu.json --cohort prose --concurrency 8
        [--noise 0.05] [--prompt-len 512] [--seeds 2] [--spec-bias 1.05] [--vocab 151936]

A profile is a profile JSON or a benchmark record holding one under "profile". Where the two
shares differ, the engine's own logic (decision ahead, calibration on measured times, the rate
bar) leads it elsewhere than the simulator's model of it; with `--noise` the effect of timing
noise on those decisions shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def priced_finish(
    engine,
    profile,
    noise: float,
    rng: random.Random,
    spec_bias: float = 1.0,
    catchup_bias: float = 1.0,
):
    """Wraps `engine.executor.finish` so that each round reports the profile's price of its
    plan (the executor's part: without the engine's host time around a speculating round,
    with the catch-up of the drafter lag it was planned with) times exp(N(0, noise)) as its
    measured time; a speculating round's price times `spec_bias` (a device where speculating
    rounds cost more than the profile says). The catch-up is reported as the round's
    `catchup_ms`, at `catchup_bias` times its price (a device where catch-ups cost more)."""
    import msgspec

    finish = engine.executor.finish

    def run(launched):
        result = finish(launched)
        plan = launched.plan
        num_spec = int((plan.decode.num_draft > 0).sum())
        depth = plan.spec_depth - 1 if num_spec else 0
        prefill_rows = sum(q.num_new for q in plan.prefills)
        lag = plan.drafter_lag_rows if depth else 0
        ms = profile.round_ms_scalar(
            plan.num_rows,
            plan.num_kv_tokens,
            depth,
            num_spec,
            lag,
            prefill_rows,
            num_draft_rows=int(plan.decode.num_draft.sum()),
            executor_only=True,
        )
        catchup = profile.catchup_profiled_ms(num_spec, lag) if depth else 0.0
        ms += (catchup_bias - 1.0) * catchup
        if depth:
            ms *= spec_bias
        ms *= math.exp(rng.gauss(0.0, noise)) if noise > 0 else 1.0
        timings = msgspec.structs.replace(
            result.timings, total_ms=ms, catchup_ms=catchup * catchup_bias
        )
        return msgspec.structs.replace(result, timings=timings)

    return run


def spec_share(routes) -> float:
    """Speculating share of the decoding request-rounds (route letters S and A)."""
    routes = list(routes)
    num_s = sum(r.count("S") for r in routes)
    num_a = sum(r.count("A") for r in routes)
    return num_s / max(num_s + num_a, 1)


def replay(
    profile_path: str,
    cohort: str,
    concurrency: int,
    *,
    noise: float = 0.0,
    prompt_len: int = 512,
    max_tokens: int = 128,
    seeds: int = 2,
    acceptance: str | None = None,
    spec_bias: float = 1.0,
    vocab: int = 0,
    catchup_bias: float = 1.0,
) -> dict:
    """Engine and simulator on the same workload and profile -> their speculating shares.
    `vocab`: the tiny model's vocabulary size (0: the preset's). A GPU run's prompts, and so
    its acceptance traces (keyed by the prompts), are drawn over its target's vocabulary: the
    replay of such a run needs the same size (151936 for `random:qwen3-8b`)."""
    from executor.drafters.synthetic import SyntheticDrafter
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine
    from hipfire_serve.types import SamplingParams
    from loadtests.lab.gpu.config import BenchConfig
    from loadtests.lab.gpu.measure import _sim_task, sim_task
    from loadtests.lab.gpu.runs import drive_refill, install, make_prompts
    from scheduler.cost_model import ProfileCost
    from scheduler.sim.acceptance_model import trace_key
    from scheduler.sim.policy_check import load_profile

    profile = load_profile(profile_path)
    model = "random:tiny"
    if vocab:
        from executor.random_model import PRESETS

        name = f"tiny-vocab{vocab}"
        PRESETS.setdefault(name, dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))
        model = f"random:{name}"
    cfg = dataclasses.replace(
        BenchConfig(),
        model=model,
        device="cpu",
        dtype="float32",
        concurrency=(concurrency,),
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        **({"acceptance": acceptance} if acceptance else {}),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "profile.json")
        Path(path).write_text(json.dumps(profile))
        engine = Engine(
            EngineConfig(
                model=cfg.model,
                draft="synthetic",
                allow_synthetic_draft=True,
                acceptance_profile=f"{cfg.acceptance}:{cohort}",
                spec_mode="adaptive",
                spec_depth=cfg.spec_depth,
                max_concurrency=concurrency,
                max_queue=cfg.num_requests(concurrency) + 1,
                max_model_len=prompt_len * 2 + max_tokens + cfg.spec_depth + 16,
                kv_cache_memory="1GiB",
                max_prefill_tokens=cfg.max_prefill_tokens,
                device="cpu",
                dtype="float32",
                seed=cfg.seed,
                cost_profile=path,
            )
        )
        engine.executor.finish = priced_finish(
            engine, ProfileCost(profile), noise, random.Random(cfg.seed), spec_bias, catchup_bias
        )
        install(
            engine,
            cfg,
            concurrency,
            "adaptive",
            path,
            SyntheticDrafter(cfg.acceptance, cohort, cfg.seed),
        )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        vocab_size = engine.target.config.vocab_size
        prompts = make_prompts(cfg, concurrency, vocab_size)
        steps, _, num_failed = drive_refill(engine, prompts, concurrency, params)
        # the engine's run (seed cfg.seed): its workload and acceptance traces
        keys = tuple(trace_key(p) for p in prompts)
        sims = [
            _sim_task(sim_task(cfg, path, cohort, "adaptive", concurrency, cfg.seed + s, keys))
            for s in range(seeds)
        ]
    sim_shares = []
    for sim in sims:
        mix = sim["route_mix"]
        sim_shares.append(mix.get("S", 0.0) / max(mix.get("S", 0.0) + mix.get("A", 0.0), 1e-12))
    return {
        "cohort": cohort,
        "concurrency": concurrency,
        "noise": noise,
        "spec_bias": spec_bias,
        "catchup_bias": catchup_bias,
        "engine_spec_share": round(spec_share(s.route for s in steps), 4),
        # tokens over the rounds' priced time (the device the profile and biases describe)
        "engine_priced_tok_s": round(
            sum(s.num_tokens for s in steps) / max(sum(s.measured_s for s in steps), 1e-9), 1
        ),
        "sim_spec_shares": [round(x, 4) for x in sim_shares],
        "num_failed": num_failed,
        "vocab": vocab_size,  # the prompts' (and the tiny model's) vocabulary
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hipfire-bench replay", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("--profile", required=True, help="profile JSON or benchmark record")
    ap.add_argument("--cohort", default="prose")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.0, help="sigma of lognormal time noise")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=2, help="simulator runs")
    ap.add_argument(
        "--catchup-bias",
        type=float,
        default=1.0,
        help="drafter catch-ups cost this many times their price (engine side only)",
    )
    ap.add_argument(
        "--vocab", type=int, default=0, help="vocabulary of the tiny model (a GPU run's target's)"
    )
    ap.add_argument(
        "--spec-bias",
        type=float,
        default=1.0,
        help="speculating rounds cost this many times the profile's price (engine side only)",
    )
    args = ap.parse_args(argv)
    if not Path(args.profile).is_file():
        print(f"policy_replay: no such profile: {args.profile}", file=sys.stderr)
        return 2
    out = replay(
        args.profile,
        args.cohort,
        args.concurrency,
        noise=args.noise,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        seeds=args.seeds,
        spec_bias=args.spec_bias,
        vocab=args.vocab,
        catchup_bias=args.catchup_bias,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
