"""Round-cost probe: where eager prefill rounds and draft-model proposals spend their time,
against what the scheduler's cost profile predicts for them.

    python3 -m loadtests.round_probe --out OUT

Measures, on a random-weight Qwen3-8B-shaped target (and a Qwen3-0.6B-shaped draft model):

a) eager prefill rounds through `RoundExecutor.run`: one chunk of 256..2048 rows at 0 or 1024
   tokens of existing context, alone and next to 32 AR decode rows at 1024 tokens of context.
   Every shape runs `--repeats` times from the same state; the first call is reported on its own
   (kernel compilation and other first-use costs land there), the others as medians of the
   executor's phases (host build, CUDA-event forward, acceptance, commit) and wall time. Each
   shape also gets the cost profile's prediction, a FLOP/byte floor, and the Triton kernels
   compiled during its calls. A scan over the number of decode rows next to a 2048-row chunk
   shows whether compilations follow the sequence count; one round is profiled kernel by kernel.
b) `DraftModelDrafter.propose` for C requests at spec depth 8 from a caught-up context, after
   two warm-up proposals: wall time with a device sync, per chain step device times (CUDA events
   around each step's forward and pick), host gaps between steps, the graphs captured and the
   kernels compiled during the measured calls, and the profile's price of the same chain.
c) Triton compilations: a hook on Triton's JIT records every kernel variant compiled (or loaded
   from the on-disk cache) while the probe runs, with its duration and specialisation, so a
   recompile per shape is visible; the Triton cache directory's entry count is a cross-check.

Writes `OUT/round_probe.json` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from executor.drafters.base import DraftRequest
from executor.drafters.draft_model import DeviceClock, DraftModelDrafter
from executor.profiler import random_setups
from executor.round_executor import RoundExecutor
from loadtests.cli_args import int_tuple
from loadtests.compile_log import CompileLog
from loadtests.probes import device_name, probe_engine
from scheduler.kv_blocks import BlockPool
from scheduler.plan import Mode, ReqPlan, RoundPlan, SamplingSpec, SeqSetup

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = REPO_ROOT / "scheduler" / "profiles" / "h200-qwen3-8b.json"
PHASES = ("build", "forward", "accept", "commit", "total")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


# -- (c) Triton compilations ------------------------------------------------------------------
def _triton_cache_dir() -> Path:
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def _cache_entries() -> int:
    d = _triton_cache_dir()
    return sum(1 for _ in d.iterdir()) if d.is_dir() else 0


# -- (a) eager prefill rounds -----------------------------------------------------------------
@dataclass(frozen=True)
class RoundShape:
    chunk: int  # prefill rows of the one chunk
    context: int  # tokens of the chunk's request already in the cache
    num_decode: int  # AR decode rows next to it
    decode_kv_len: int  # context tokens of each decoding request

    @property
    def num_rows(self) -> int:
        return self.chunk + self.num_decode

    @property
    def num_kv_tokens(self) -> int:
        """The scheduler's count: num_computed + num_new summed over the requests."""
        return self.context + self.chunk + self.num_decode * self.decode_kv_len

    @property
    def attention_keys(self) -> int:
        """(query row, visible key) pairs of the round: causal chunk plus the decode rows."""
        c = self.chunk
        return c * self.context + c * (c + 1) // 2 + self.num_decode * self.decode_kv_len

    def label(self) -> str:
        extra = f" + {self.num_decode} AR@{self.decode_kv_len}" if self.num_decode else ""
        return f"chunk {self.chunk} @ctx {self.context}{extra}"


def predicted_ms(cost_model, shape: RoundShape) -> dict | None:
    """The cost profile's uncorrected price of the round (the scheduler's raw prediction) and
    its two terms: the dense row curve and the KV term."""
    if cost_model is None:
        return None
    p = cost_model.profile
    return {
        "predicted_ms": round(
            float(
                p.round_ms_scalar(shape.num_rows, shape.num_kv_tokens, num_prefill_rows=shape.chunk)
            ),
            3,
        ),
        "dense_ms": round(float(p.target_ms(shape.num_rows)), 3),
        "kv_ms": round(float(p.attention_ms(shape.num_kv_tokens)), 3),
    }


def floor_ms(model, shape: RoundShape, ceilings: dict) -> dict | None:
    """max(FLOPs / GEMM rate, bytes / copy rate) of the round with the ceilings measured now:
    dense layers over every row, the LM head over the sampled rows only, causal attention."""
    if not ceilings:
        return None
    cfg = model.config
    w = model.weights
    head = w.lm_head.numel()
    layer_params = model.num_params - w.embed.numel() - (0 if w.lm_head is w.embed else head)
    num_logit = shape.num_decode + 1
    dense = 2 * layer_params * shape.num_rows + 2 * head * num_logit
    attn = 4 * shape.attention_keys * cfg.q_size * cfg.num_layers
    elt = w.embed.element_size()
    num_bytes = model.num_params * elt + shape.num_kv_tokens * cfg.kv_bytes_per_token(elt)
    t_flops = (dense + attn) / (ceilings["bf16_gemm_TFLOPs"] * 1e12) * 1e3
    t_bytes = num_bytes / (ceilings["copy_read_plus_write_TBps"] * 1e12) * 1e3
    return {
        "floor_ms": round(max(t_flops, t_bytes), 3),
        "attention_ms_at_gemm_rate": round(attn / (ceilings["bf16_gemm_TFLOPs"] * 1e12) * 1e3, 3),
    }


class PrefillRounds:
    """Builds one-chunk prefill rounds (optionally with AR decode rows) on a `RoundExecutor`
    and times `run` on them from the same state every call, as `RoundTimer` does for decode
    rounds (same slot set-up, same block pool, drafter out of the way)."""

    def __init__(self, executor: RoundExecutor, log: CompileLog):
        self.ex = executor
        self.log = log
        self.pool = BlockPool(executor.kv.num_blocks, executor.block_size)

    def _plan(self, shape: RoundShape) -> tuple[list[SeqSetup], RoundPlan]:
        ex = self.ex
        if shape.num_decode + 1 > ex.max_slots:
            raise ValueError(f"{shape.num_decode} decode rows + a chunk need more slots")
        bs = ex.block_size
        vocab = ex.target.config.vocab_size
        g = torch.Generator().manual_seed(shape.chunk * 7919 + shape.context + shape.num_decode)
        setups, decode_blocks = random_setups(
            ex, self.pool, shape.num_decode, shape.decode_kv_len, 1, g
        )
        reqs = [
            ReqPlan(
                req_id=slot,
                slot=slot,
                mode=Mode.AR,
                num_computed=shape.decode_kv_len - 1,
                num_new=1,
                new_block_ids=blocks,
            )
            for slot, blocks in enumerate(decode_blocks)
        ]
        slot = shape.num_decode
        prompt_len = shape.context + shape.chunk
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        blocks = self.pool.allocate(slot, -(-prompt_len // bs))
        setups.append(
            SeqSetup(
                req_id=slot, slot=slot, context_token_ids=tuple(prompt), sampling=SamplingSpec()
            )
        )
        reqs.append(
            ReqPlan(
                req_id=slot,
                slot=slot,
                mode=Mode.PREFILL,
                num_computed=shape.context,
                num_new=shape.chunk,
                new_block_ids=blocks,
                sample=True,
            )
        )
        plan = RoundPlan.from_reqs(
            reqs,
            round_id=0,
            num_rows=shape.num_rows,
            row_bucket=0,
            num_kv_tokens=shape.num_kv_tokens,
        )
        return setups, plan

    def _reset(self, shape: RoundShape) -> None:
        """Back to the state before the round: the decode slots at their context, the chunk's
        slot with `context` tokens computed of its prompt (the KV contents do not matter)."""
        ex = self.ex
        for slot in range(shape.num_decode):
            ex.rewind(slot, shape.decode_kv_len)
        slot = shape.num_decode
        ex.context_len[slot] = shape.context + shape.chunk
        ex.num_computed[slot] = shape.context

    def measure(self, shape: RoundShape, repeats: int) -> dict:
        """`repeats` calls of `run` on the round (at least one): the first on its own, the
        medians of the others (zeros when there are none)."""
        ex = self.ex
        setups, plan = self._plan(shape)
        saved_drafter = ex.drafter
        ex.drafter = None
        ex._apply_setup_release(RoundPlan(round_id=0, setup=tuple(setups)))
        self.log.stage = shape.label()
        calls = []
        try:
            for _ in range(max(repeats, 1)):
                self._reset(shape)
                _sync(ex.device)
                mark = self.log.mark()
                t0 = time.perf_counter()
                result = ex.run(plan)
                _sync(ex.device)
                wall_ms = (time.perf_counter() - t0) * 1e3
                t = result.timings
                calls.append(
                    {
                        "wall_ms": wall_ms,
                        **{f"{name}_ms": getattr(t, f"{name}_ms") for name in PHASES},
                        "compiles": self.log.since(mark),
                    }
                )
        finally:
            ex._apply_setup_release(
                RoundPlan(round_id=0, release=tuple(range(shape.num_decode + 1)))
            )
            ex.drafter = saved_drafter
            for slot in range(shape.num_decode + 1):
                self.pool.free(slot)
        first, rest = calls[0], calls[1:]
        keys = ["wall_ms"] + [f"{name}_ms" for name in PHASES]
        return {
            "shape": asdict(shape),
            "label": shape.label(),
            "num_rows": shape.num_rows,
            "num_kv_tokens": shape.num_kv_tokens,
            "first": {k: round(first[k], 3) for k in keys} | {"compiles": first["compiles"]},
            "median_rest": {k: round(_median(c[k] for c in rest), 3) for k in keys},
            "compiles_rest": sum(c["compiles"]["count"] for c in rest),
            "calls": len(calls),
        }


def kernel_table(bench: PrefillRounds, shape: RoundShape, row_limit: int = 10) -> dict:
    """One round of `shape` (measured before, so warm) under the torch profiler: the kernels
    (device ops on a CPU) with the most time."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = bench.ex.device.type == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        bench.measure(shape, 1)
    averages = prof.key_averages()
    sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"

    def device_us(e) -> float:
        if on_gpu:
            return float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)))
        return float(e.cpu_time_total)

    top = sorted(averages, key=device_us, reverse=True)[:row_limit]
    return {
        "shape": shape.label(),
        "rounds": 1,
        "top": [
            {"name": e.key[:120], "calls": e.count, "total_us": round(device_us(e), 1)} for e in top
        ],
        "table": averages.table(sort_by=sort_by, row_limit=row_limit),
    }


# -- (b) draft-model proposals ----------------------------------------------------------------
class StepClock:
    """Marks the device timeline around each drafting step of one `propose`: before the step's
    forward and after its pick (CUDA events on a GPU, read after the proposal's own copy back
    has synchronised; the host clock on a CPU, where work runs as it is issued). Installed by
    wrapping the drafter instance's `_forward_logits` and `_pick`; removed on exit."""

    def __init__(self, drafter: DraftModelDrafter):
        self.drafter = drafter
        self.clock = DeviceClock(drafter.device)
        self.starts: list = []
        self.ends: list = []

    def __enter__(self) -> StepClock:
        d = self.drafter
        forward, pick = d._forward_logits, d._pick

        def timed_forward(*args, **kwargs):
            self.starts.append(self.clock.now())
            return forward(*args, **kwargs)

        def timed_pick(*args, **kwargs):
            out = pick(*args, **kwargs)
            self.ends.append(self.clock.now())
            return out

        d._forward_logits, d._pick = timed_forward, timed_pick
        return self

    def __exit__(self, *exc) -> None:
        del self.drafter._forward_logits, self.drafter._pick

    def steps_ms(self) -> list[float]:
        """Per forward: step 0 (each of its passes), then the chain steps."""
        return [self.clock.ms(a, b) for a, b in zip(self.starts, self.ends)]

    def gaps_ms(self) -> list[float]:
        """Device time between one step's pick and the next step's forward (host stalls)."""
        return [self.clock.ms(a, b) for a, b in zip(self.ends, self.starts[1:])]


def make_drafter(model, max_reqs: int, max_context: int, depth: int) -> DraftModelDrafter:
    """A draft-model drafter for `max_reqs` requests of up to `max_context` tokens, built as
    `executor.profiler.time_draft_steps` builds it."""
    from executor.profiler import standalone_drafter

    return standalone_drafter(model, max_reqs, max_context, depth)


def measure_propose(
    drafter: DraftModelDrafter,
    num_reqs: int,
    context_len: int,
    depth: int,
    repeats: int,
    log: CompileLog,
    cost_model=None,
) -> dict:
    """`propose` for `num_reqs` greedy requests drafting depth - 1 tokens each from a context of
    `context_len` tokens the drafter has caught up on (two warm-up proposals first: the first
    catches up, both may capture graphs)."""
    dev = drafter.device
    chain = depth - 1
    vocab = drafter.model.config.vocab_size
    g = torch.Generator().manual_seed(num_reqs * 131 + context_len)
    contexts = torch.randint(0, vocab, (num_reqs, context_len), generator=g).tolist()
    for slot in range(num_reqs):
        drafter.setup(slot, contexts[slot])
    requests = [
        DraftRequest(slot, contexts[slot], chain, temperature=0.0) for slot in range(num_reqs)
    ]
    greedy = [True] * num_reqs

    def num_graphs() -> int | None:
        return drafter.num_graphs if drafter.graphs is not None else None

    log.stage = f"propose C={num_reqs} ctx={context_len} warm-up"
    warm_mark, warm_graphs = log.mark(), num_graphs()
    t0 = time.perf_counter()
    for _ in range(2):
        drafter.propose(requests, greedy)
    _sync(dev)
    warm_s = time.perf_counter() - t0
    graphs_after_warm = num_graphs()
    log.stage = f"propose C={num_reqs} ctx={context_len}"
    mark = log.mark()
    walls, steps, gaps, spans, step0 = [], [], [], [], []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        with StepClock(drafter) as clock:
            drafter.propose(requests, greedy)  # ends with the copy of the drafts to the host
            _sync(dev)
            walls.append((time.perf_counter() - t0) * 1e3)
            s = clock.steps_ms()
            step0.append(s[0])
            steps.append(_median(s[1:]) if len(s) > 1 else 0.0)
            gaps.append(sum(clock.gaps_ms()))
            spans.append(sum(s) + gaps[-1])
    graphs_end = num_graphs()
    out = {
        "num_reqs": num_reqs,
        "context_len": context_len,
        "depth": depth,
        "chain_steps": chain,
        "warmup_s": round(warm_s, 3),
        "warmup_compiles": log.since(warm_mark)["count"] - log.since(mark)["count"],
        "graphs_captured_in_warmup": (
            None if warm_graphs is None else graphs_after_warm - warm_graphs
        ),
        "graphs_captured_in_measured": (
            None if graphs_end is None else graphs_end - graphs_after_warm
        ),
        "compiles_in_measured": log.since(mark)["count"],
        "wall_ms": round(_median(walls), 3),
        "wall_ms_per_step": round(_median(walls) / chain, 3),
        "device_step0_ms": round(_median(step0), 3),
        "device_chain_step_ms": round(_median(steps), 3),
        "device_gaps_ms": round(_median(gaps), 3),
        "device_span_ms": round(_median(spans), 3),
        "host_outside_span_ms": round(_median(walls) - _median(spans), 3),
    }
    if cost_model is not None:
        step = float(cost_model.profile.draft_step_ms(num_reqs))
        out["profile_step_ms"] = round(step, 3)
        # the cost model's chain of `chain` drafts: one step with the catch-up rows (none
        # here), then chain - 1 plain steps
        out["profile_chain_ms"] = round(step * chain, 3)
    for slot in range(num_reqs):
        drafter.release(slot)
    return out


# -- (d) the refill workload through the engine --------------------------------------------
def refill_replay(
    engine, num_reqs: int, prompt_lo: int, prompt_hi: int, max_tokens: int, log: CompileLog
) -> dict:
    """The end-to-end benchmark's all-AR refill at C = `num_reqs` (prompts uniform in
    [prompt_lo, prompt_hi] tokens, greedy, ignore_eos), run through `Engine.step` right after
    start-up: per step its wall time, the Triton compilations and graph captures inside it, and
    the rounds it finished (route, rows, the scheduler's prediction, the executor's time), so
    a slow round shows what it paid for."""
    from hipfire_serve.types import SamplingParams

    vocab = engine.target.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.stats()  # drains the round records of the start-up
    for i in range(num_reqs):
        n = int(rng.integers(prompt_lo, prompt_hi + 1))
        engine.add_request(f"replay-{i}", rng.integers(1, vocab, n).tolist(), params)
    graphs = engine.executor.graphs

    def num_graphs() -> int:
        return len(graphs.graphs) if graphs is not None else 0

    steps = []
    t_run = time.perf_counter()
    while engine.has_unfinished():
        log.stage = f"refill step {len(steps)}"
        mark, graphs_before = log.mark(), num_graphs()
        t0 = time.perf_counter()
        engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        rounds = [
            {
                "route": f"P{r.num_prefill} A{r.num_ar} S{r.num_spec}",
                "rows": r.num_rows,
                "predicted_ms": round(r.predicted_s * 1e3, 3),
                "measured_ms": round(r.measured_s * 1e3, 3),
                "forward_ms": round(r.phase_s.get("forward", 0.0) * 1e3, 3),
                "phase_ms": {k: round(v * 1e3, 3) for k, v in r.phase_s.items()},
            }
            for r in engine.stats().rounds
            if r.num_rows  # (a round that only releases slots runs nothing)
        ]
        steps.append(
            {
                "step": len(steps),
                "wall_ms": round(wall_ms, 3),
                "compiles": log.since(mark),
                "graphs_captured": num_graphs() - graphs_before,
                "rounds": rounds,
            }
        )
    run_s = time.perf_counter() - t_run
    prefill = [r for s in steps for r in s["rounds"] if not r["route"].startswith("P0")]
    decode = [r for s in steps for r in s["rounds"] if r["route"].startswith("P0")]
    return {
        "num_reqs": num_reqs,
        "prompt_range": [prompt_lo, prompt_hi],
        "max_tokens": max_tokens,
        # rounds ahead: an advanced round's measured time covers only its finish
        "overlap_rounds": getattr(engine.config, "overlap_rounds", None),
        "run_s": round(run_s, 3),
        "tok_s": round(num_reqs * max_tokens / run_s, 1),
        "prefill_rounds": len(prefill),
        "prefill_measured_ms": round(sum(r["measured_ms"] for r in prefill), 2),
        "prefill_predicted_ms": round(sum(r["predicted_ms"] for r in prefill), 2),
        "decode_rounds": len(decode),
        "decode_measured_ms": round(sum(r["measured_ms"] for r in decode), 2),
        "decode_predicted_ms": round(sum(r["predicted_ms"] for r in decode), 2),
        "compiles": sum(s["compiles"]["count"] for s in steps),
        "compile_s": round(sum(s["compiles"]["seconds"] for s in steps), 3),
        "graphs_captured": sum(s["graphs_captured"] for s in steps),
        "steps": steps,
    }


# -- the whole probe --------------------------------------------------------------------------
def build_engine(args):
    slots = max((args.decode_rows, *int_tuple(args.seq_scan))) + 1
    return probe_engine(
        args,
        max(slots, 2),
        args.draft_depth,
        args.max_model_len,
        cost_profile=args.profile or "auto",
    )


def _print_rounds(rounds: list[dict]) -> None:
    print(
        f"{'round':<36} {'rows':>5} {'1st ms':>8} {'1st cmp':>8} {'wall':>8} {'build':>6} "
        f"{'fwd ev':>8} {'accept':>7} {'commit':>6} {'pred':>7} {'x pred':>6} {'floor':>7}"
    )
    for r in rounds:
        m, f = r["median_rest"], r["first"]
        pred = (r.get("prediction") or {}).get("predicted_ms")
        floor = (r.get("floor") or {}).get("floor_ms")
        cmp_ = f"{f['compiles']['count']}/{f['compiles']['seconds']:.1f}s"
        print(
            f"{r['label']:<36} {r['num_rows']:>5} {f['wall_ms']:>8.1f} {cmp_:>8} "
            f"{m['wall_ms']:>8.2f} {m['build_ms']:>6.2f} {m['forward_ms']:>8.2f} "
            f"{m['accept_ms']:>7.2f} {m['commit_ms']:>6.2f} "
            f"{pred if pred is not None else '-':>7} "
            f"{(m['wall_ms'] / pred) if pred else float('nan'):>6.2f} "
            f"{floor if floor is not None else '-':>7}"
        )


def _print_drafts(drafts: list[dict]) -> None:
    print(
        f"{'C':>4} {'ctx':>5} {'wall ms':>8} {'/step':>7} {'step0':>7} {'chain st':>8} "
        f"{'gaps':>7} {'host out':>8} {'prof st':>7} {'graphs':>6} {'cmp':>4}"
    )
    for d in drafts:
        print(
            f"{d['num_reqs']:>4} {d['context_len']:>5} {d['wall_ms']:>8.2f} "
            f"{d['wall_ms_per_step']:>7.3f} {d['device_step0_ms']:>7.3f} "
            f"{d['device_chain_step_ms']:>8.3f} {d['device_gaps_ms']:>7.3f} "
            f"{d['host_outside_span_ms']:>8.3f} {d.get('profile_step_ms', '-'):>7} "
            f"{d['graphs_captured_in_measured']!s:>6} {d['compiles_in_measured']:>4}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--draft", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", default="16GiB")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="cost profile JSON ('' none)")
    ap.add_argument("--chunks", default="256,512,1024,2048")
    ap.add_argument("--contexts", default="0,1024")
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--decode-kv-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=4, help="calls per round shape (first apart)")
    ap.add_argument(
        "--seq-scan",
        default="28,29,30,31,32,33,34,35,36",
        help="decode rows next to the largest chunk at the largest context, one shape each",
    )
    ap.add_argument("--replay-reqs", type=int, default=32, help="refill replay C (0: none)")
    ap.add_argument("--replay-prompts", default="512,1536", help="prompt length range")
    ap.add_argument("--replay-max-tokens", type=int, default=32)
    ap.add_argument("--draft-reqs", default="1,16,64")
    ap.add_argument("--draft-contexts", default="16,1024")
    ap.add_argument("--draft-depth", type=int, default=8)
    ap.add_argument("--draft-repeats", type=int, default=5)
    ap.add_argument(
        "--time-budget", type=float, default=150.0, help="seconds; later parts are skipped past it"
    )
    ap.add_argument(
        "--keep-triton-cache",
        action="store_true",
        help="use Triton's usual cache directory (default: a fresh one, so compile costs are "
        "those of a cold start and counted the same on every run)",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("round_probe: no CUDA/HIP device")
        return 2
    saved_cache_dir = os.environ.get("TRITON_CACHE_DIR")
    fresh_cache = None
    if not args.keep_triton_cache:
        fresh_cache = tempfile.mkdtemp(prefix="round-probe-triton-")
        os.environ["TRITON_CACHE_DIR"] = fresh_cache
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = CompileLog().install()
    try:
        record = run_probe(args, device, log, out)
    finally:
        log.uninstall()
        if fresh_cache is not None:
            if saved_cache_dir is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved_cache_dir
            shutil.rmtree(fresh_cache, ignore_errors=True)
    print_report(record)
    return 0


def run_probe(args, device: torch.device, log: CompileLog, out: Path) -> dict:
    """The probe's parts in order of importance, the JSON rewritten after each one, and the
    parts still to come skipped once `--time-budget` is spent."""
    from executor.profiler import measure_ceilings
    from scheduler.cost_model import CostModel

    t_start = time.perf_counter()
    cache_before = _cache_entries()
    record: dict = {
        "device": device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "model": args.model,
        "draft": args.draft,
        "profile": Path(args.profile).name if args.profile else None,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "replay": None,
        "rounds": [],
        "seq_scan": [],
        "kernel_table": None,
        "drafts": [],
        "skipped": [],
    }

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start <= args.time_budget:
            return False
        record["skipped"].append(what)
        return True

    def save() -> None:
        record.update(
            compile_method=log.method,
            compile_hook_errors=log.errors[:20],
            compiles_total=len(log.events),
            compile_summary=log.summary(),
            compile_events=[{k: v for k, v in e.items() if k != "key"} for e in log.events],
            triton_cache_entries_added=_cache_entries() - cache_before,
            elapsed_s=round(time.perf_counter() - t_start, 1),
        )
        (out / "round_probe.json").write_text(json.dumps(record, indent=1, default=str))

    log.stage = "engine build"
    t0 = time.perf_counter()
    engine = build_engine(args)
    record["engine_build_s"] = round(time.perf_counter() - t0, 2)
    record["engine_build_compiles"] = log.since(0)
    ceilings = measure_ceilings(device)
    record["ceilings"] = ceilings
    cost_model = CostModel.from_file(args.profile) if args.profile else None
    bench = PrefillRounds(engine.executor, log)
    save()

    # (d) first, as a server meets it after start-up: the refill workload, step by step
    if args.replay_reqs > 0 and not over_budget("refill replay"):
        lo, hi = int_tuple(args.replay_prompts)
        record["replay"] = refill_replay(
            engine, args.replay_reqs, lo, hi, args.replay_max_tokens, log
        )
        rp = record["replay"]
        print(
            f"refill replay C={args.replay_reqs}: {rp['run_s']:.2f} s, {rp['compiles']} "
            f"compiles ({rp['compile_s']:.1f} s), {rp['graphs_captured']} graph captures",
            flush=True,
        )
        save()

    # (a) prefill rounds: alone, then with the decode rows
    for num_decode in (0, args.decode_rows):
        for ctx in int_tuple(args.contexts):
            for chunk in int_tuple(args.chunks):
                shape = RoundShape(chunk, ctx, num_decode, args.decode_kv_len)
                if over_budget(shape.label()):
                    continue
                r = bench.measure(shape, args.repeats)
                r["prediction"] = predicted_ms(cost_model, shape)
                r["floor"] = floor_ms(engine.target, shape, ceilings)
                record["rounds"].append(r)
                f = r["first"]
                print(
                    f"{r['label']}: first {f['wall_ms']:.1f} ms ({f['compiles']['count']} "
                    f"compiles), then {r['median_rest']['wall_ms']:.2f} ms",
                    flush=True,
                )
    save()

    # (b) the draft model's proposals
    draft_model = getattr(engine.drafter, "model", None)
    if draft_model is not None:
        reqs, ctxs = int_tuple(args.draft_reqs), int_tuple(args.draft_contexts)
        drafter = make_drafter(draft_model, max(reqs), max(ctxs), args.draft_depth)
        for ctx in ctxs:
            for n in reqs:
                if over_budget(f"propose C={n} ctx={ctx}"):
                    continue
                d = measure_propose(
                    drafter, n, ctx, args.draft_depth, args.draft_repeats, log, cost_model
                )
                record["drafts"].append(d)
                print(f"propose C={n} ctx={ctx}: {d['wall_ms']:.2f} ms", flush=True)
        del drafter
        save()

    # the sequence-count scan and one round kernel by kernel
    big, ctx_hi = max(int_tuple(args.chunks)), max(int_tuple(args.contexts))
    for n in int_tuple(args.seq_scan):
        shape = RoundShape(big, ctx_hi, n, args.decode_kv_len)
        if over_budget(shape.label()):
            continue
        r = bench.measure(shape, 2)
        r["prediction"] = predicted_ms(cost_model, shape)
        record["seq_scan"].append(r)
    save()
    shape = RoundShape(big, ctx_hi, args.decode_rows, args.decode_kv_len)
    if not over_budget("kernel table"):
        log.stage = "kernel table"
        record["kernel_table"] = kernel_table(bench, shape)
    save()
    return record


def print_report(record: dict) -> None:
    compiles = record["engine_build_compiles"]
    print(
        f"\nengine build {record['engine_build_s']:.1f} s, {compiles['count']} Triton compiles "
        f"({compiles['seconds']:.1f} s)"
    )
    rp = record["replay"]
    if rp:
        print(
            f"\n(d) refill replay C={rp['num_reqs']}, prompts {rp['prompt_range']}, "
            f"{rp['max_tokens']} tokens: {rp['run_s']:.2f} s ({rp['tok_s']} tok/s); prefill "
            f"rounds {rp['prefill_rounds']}: measured {rp['prefill_measured_ms']:.1f} ms, "
            f"predicted {rp['prefill_predicted_ms']:.1f} ms; decode rounds "
            f"{rp['decode_rounds']}: measured {rp['decode_measured_ms']:.1f} ms, predicted "
            f"{rp['decode_predicted_ms']:.1f} ms; {rp['compiles']} compiles "
            f"({rp['compile_s']:.1f} s), {rp['graphs_captured']} graph captures"
        )
        for st in rp["steps"]:
            slow = any(r["measured_ms"] > 1.5 * r["predicted_ms"] for r in st["rounds"])
            if slow or st["compiles"]["count"] or st["graphs_captured"]:
                rounds = "; ".join(
                    f"{r['route']} rows {r['rows']} pred {r['predicted_ms']:.1f} meas "
                    f"{r['measured_ms']:.1f} fwd {r['forward_ms']:.1f}"
                    for r in st["rounds"]
                )
                print(
                    f"  step {st['step']:>3}: {st['wall_ms']:8.1f} ms, compiles "
                    f"{st['compiles']['count']} ({st['compiles']['seconds']:.2f} s: "
                    f"{', '.join(st['compiles']['kernels'])}), captures "
                    f"{st['graphs_captured']}; {rounds}"
                )
    print(
        "\n(a) prefill rounds (ms; medians of the calls after the first; 1st cmp: compiles in "
        "the first call / their seconds; pred: cost profile; floor: FLOP/byte ceiling)"
    )
    _print_rounds(record["rounds"])
    if record["drafts"]:
        print("\n(b) draft proposals (ms; device step times from CUDA events)")
        _print_drafts(record["drafts"])
    if record["seq_scan"]:
        print("\nscan: decode rows next to the largest chunk (first call: compiles)")
        for r in record["seq_scan"]:
            f = r["first"]
            print(
                f"  {r['label']:<36} first {f['wall_ms']:8.1f} ms  compiles "
                f"{f['compiles']['count']} ({', '.join(f['compiles']['kernels'])})  then "
                f"{r['median_rest']['wall_ms']:.2f} ms"
            )
    table = record["kernel_table"]
    if table:
        print(f"\nkernels of one round of {table['shape']} (torch profiler):")
        print(table["table"])
    print(
        f"\n(c) Triton compiles: {record['compiles_total']} via {record['compile_method']}; "
        f"cache entries added {record['triton_cache_entries_added']}"
    )
    for s in record["compile_summary"]:
        print(
            f"  {s['kernel']:<34} {s['variants']:>3} variants {s['seconds']:>7.2f} s  "
            f"differ in {json.dumps(s['differs_in'])[:300]}"
        )
    if record["compile_hook_errors"]:
        print(f"  hook errors: {record['compile_hook_errors'][:3]}")
    if record["skipped"]:
        print(f"\nskipped past the time budget: {record['skipped']}")
    print(f"\nround_probe.json written; {record['elapsed_s']} s")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
