"""One engine in its own process: `python -m loadtests.lab.phases.child ENGINE SPEC OUT`. The
engine is built by `peer-vllm`'s child builders (plain decoding, greedy, EOS ignored, no
prefix caching); vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so the profiler here sees its kernels. Per C, one wave:

  add C requests of `prompt_len` prompts; step until every one has its first token (prefill);
  `warmup_steps` steps (graphs captured); `steps` steps timed (wall, no profiler);
  `steps` steps under torch.profiler (CPU + CUDA activity), the device synchronised at both
  ends of each window; then step until the requests finish.
A window's decode steps are its output tokens / C, so a step call that only schedules (vLLM's
batch queue) or finishes the round before (ours, rounds launched ahead) counts right: with the
device idle at the window's start, the kernels of the rounds launched in it and the tokens of
the rounds finished in it are both one per step. The result is rewritten after every point."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from loadtests.lab.peer.drive import FIT_MARGIN, STALL_S, one_line, write_json
from loadtests.lab.peer.workloads import wave_prompts
from loadtests.lab.phases.classify import device_events, summarize
from loadtests.lab.phases.config import PhaseConfig


class Wave:
    """The live requests of one wave: tokens so far per request, the finished ones."""

    def __init__(self, backend, num_seqs: int):
        self.backend, self.num_seqs = backend, num_seqs
        self.got: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
        for i, prompt in enumerate(prompts):
            rid = f"{tag}-{i}"
            self.got[rid] = 0
            self.backend.add(rid, prompt, max_tokens)

    def step(self) -> int:
        """One engine step; the tokens it brought."""
        num = 0
        for rid, new, finished in self.backend.step():
            if rid in self.got:
                self.got[rid] += new
                num += new
                if finished:
                    self.finished.add(rid)
        return num

    def window(self, num_calls: int) -> tuple[int, float]:
        """`num_calls` steps: (tokens, wall seconds). A request finishing inside is an error:
        the window would hold fewer rows than C."""
        t0, tokens = time.perf_counter(), 0
        for _ in range(num_calls):
            tokens += self.step()
        if self.finished:
            raise RuntimeError(f"{len(self.finished)} requests finished inside a window")
        return tokens, time.perf_counter() - t0

    def until(self, done, what: str) -> None:
        t_token = time.perf_counter()
        while not done():
            if self.step():
                t_token = time.perf_counter()
            elif time.perf_counter() - t_token > STALL_S:
                raise RuntimeError(f"no token for {STALL_S:.0f} s waiting for {what}")


def profile_point(backend, cfg: PhaseConfig, c: int, vocab: int, use_cuda: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize()

    prompts = wave_prompts(cfg.peer_config(), c, vocab)
    wave = Wave(backend, c)
    t0 = time.perf_counter()
    wave.add(prompts, cfg.max_tokens(c), f"ph{c}")
    wave.until(lambda: all(wave.got.values()), "the prefill")
    prefill_s = time.perf_counter() - t0
    wave.window(cfg.warmup_steps)
    sync()
    t_wall = time.perf_counter()
    tokens, _ = wave.window(cfg.steps)
    sync()
    wall_s = time.perf_counter() - t_wall
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with profile(activities=activities) as prof:
        sync()
        t_prof = time.perf_counter()
        tokens_prof, _ = wave.window(cfg.steps)
        sync()
        wall_prof_s = time.perf_counter() - t_prof
        t_stop = time.perf_counter()
    events = device_events(prof)
    parse_s = time.perf_counter() - t_stop  # the profiler's stop and parse, and ours
    wave.until(lambda: len(wave.finished) == c, "the requests to finish")
    steps, steps_prof = tokens / c, tokens_prof / c
    if not steps or not steps_prof:
        raise RuntimeError("no decode tokens in a window")
    return {
        "C": c,
        "prompt_tokens": sum(map(len, prompts)),
        "prefill_s": prefill_s,
        "step_calls": cfg.steps,
        "steps_unprofiled": steps,
        "wall_ms": wall_s / steps * 1e3,
        "steps": steps_prof,
        "wall_ms_profiled": wall_prof_s / steps_prof * 1e3,
        "parse_s": parse_s,
        **summarize(events, steps_prof),
    }


def _build(engine: str, spec: dict, result: dict):
    if engine == "vllm":
        # the engine core in this process: its kernels are this process's profiler's
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from loadtests.lab.peer.vllm_child import build
    else:
        from loadtests.lab.peer.hipfire_child import build
    backend, vocab = build(spec, result)
    if engine == "vllm":
        core = getattr(backend.engine, "engine_core", None)
        result["settings"]["engine_core_client"] = type(core).__name__
    return backend, vocab


def run_points(backend, cfg: PhaseConfig, vocab: int, deadline: float, result: dict, save):
    """Every C in grid order until `deadline` (epoch seconds): a point whose expected time (the
    previous point's, scaled by C) does not fit is skipped; one that raises is listed and
    stops the grid (the engine's state after it is unknown)."""
    use_cuda = result.get("device_name", "cpu") != "cpu"
    prev: tuple[int, float] | None = None
    for c in cfg.concurrency:
        expect = prev[1] * c / prev[0] if prev else 0.0
        if time.time() + FIT_MARGIN * expect > deadline:
            result["skipped"].append({"C": c, "expected_s": expect})
            continue
        t0 = time.perf_counter()
        try:
            point = profile_point(backend, cfg, c, vocab, use_cuda)
        except Exception as e:
            result["errors"].append({"C": c, "error": one_line(e)})
            save()
            break
        prev = (c, time.perf_counter() - t0)
        point["elapsed_s"] = prev[1]
        result["points"].append(point)
        brief = {k: point[k] for k in ("C", "steps", "wall_ms", "busy_ms", "num_kernels")}
        print(f"[{result['engine']}] {json.dumps(brief)}", flush=True)
        save()


def main() -> int:
    engine, spec_path, out_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    cfg = PhaseConfig.from_json(spec["phase_config"])
    result: dict = {"engine": engine, "points": [], "skipped": [], "errors": []}
    t0 = time.perf_counter()
    try:
        backend, vocab = _build(engine, {**spec, "config": cfg.peer_config().to_json()}, result)
        result["startup_s"] = time.perf_counter() - t0
    except Exception as e:
        result["error"] = one_line(e)
        write_json(out_path, result)
        print(f"[{engine}] failed: {result['error']}", file=sys.stderr, flush=True)
        return 1
    write_json(out_path, result)
    run_points(backend, cfg, vocab, spec["deadline"], result, lambda: write_json(out_path, result))
    result["elapsed_s"] = time.perf_counter() - t0
    write_json(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
