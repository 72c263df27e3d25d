"""`build_profile`: the cost profile of an engine's target (and drafter) measured on its device,
from whole executor rounds (`executor.profiling`) and whole engine steps (`engine_steps`)."""

from __future__ import annotations

import copy
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor.drafters.block_model import BlockDraftModel
from executor.drafters.draft_model import MAX_CATCHUP_PASSES
from executor.profiling.device import measure_ceilings
from executor.profiling.drafts import (
    CATCHUP_PROMPT_ROWS,
    catchup_profile_rows,
    draft_bench,
    draft_kv_slope,
    host_drafter_profile,
    time_draft_catchup,
    time_draft_proposals,
    time_draft_steps,
)
from executor.profiling.rounds import RoundTimer, time_prefill_rows, time_rounds_ahead
from executor.round_executor import RoundExecutor
from hipfire_serve.cost_profile.blocks import block_drafter_sections, with_context_write
from hipfire_serve.cost_profile.engine_steps import (
    host_points,
    time_ar_restart,
    time_engine_overhead,
    time_spec_round_ratio,
)
from hipfire_serve.cost_profile.hybrid import recurrent_section

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
DEFAULT_KV_LENS = (16, 512, 2048)
SPEC_REPEATS = 5  # repeats of the speculating shapes: ~50 of them in a profile built every run
# Contexts of the draft KV slope (`draft_kv_slope`): the reference and up to DRAFT_KV_SPAN times
# it, where the model's context allows at least DRAFT_KV_MIN_SPAN times it (a shorter span
# leaves the slope to noise); speculating request counts between these bounds (the largest two).
DRAFT_KV_SPAN = 2.0
DRAFT_KV_MIN_SPAN = 1.25
DRAFT_KV_COUNTS = (4, 32)


def _interp(points: list[list[float]], x: float) -> float:
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return float(np.interp(x, xs, ys)) if points else 0.0


def _spec_counts(max_slots: int) -> tuple[int, ...]:
    """Speculating request counts profiled: the powers of two below the slot count, and it."""
    powers = {1 << i for i in range(max_slots.bit_length())}
    return tuple(sorted({n for n in powers if n < max_slots} | {max_slots}))


def _spec_rows_per_seq(spec_depth: int) -> tuple[int, ...]:
    """Rows per speculating sequence profiled (1 + drafts): 2, 4 and 8 within the spec depth."""
    return tuple(sorted({min(r, spec_depth) for r in (2, 4, 8)} - {1}))


def _draft_kv_fields(model, spec_counts, spec_depth, ref, engine, repeats, ex, bench) -> dict:
    """The profile's `draft_model.kv_ms_per_token` and its points (absent: no longer context
    fits the model, or the draft depth is 1)."""
    long_len = min(int(ref * DRAFT_KV_SPAN), engine.max_model_len - spec_depth - 2)
    lo, hi = DRAFT_KV_COUNTS
    counts = tuple(k for k in spec_counts if lo <= k <= hi)[-2:]
    depth = spec_depth - 1
    if long_len < ref * DRAFT_KV_MIN_SPAN or not counts or depth < 1:
        return {}
    fit = draft_kv_slope(model, counts, depth, ref, long_len, repeats, ex.max_blocks_per_seq, bench)
    return {
        "kv_ms_per_token": fit["kv_ms_per_token"],
        "kv_points": fit["points"],
        "kv_long_context_len": long_len,
    }


def build_profile(
    engine: Engine,
    rows=DEFAULT_ROWS,
    kv_lens=DEFAULT_KV_LENS,
    repeats: int = 10,
    with_ceilings: bool = True,
    ref_kv_len: int | None = None,
    host_overhead: bool = True,
) -> dict:
    """Measures the profile of an `Engine`'s target (and draft model, if any).

    The cost model prices a round as `rows_ms(rows) + kv_tokens * kv_ms_per_token`. Attention
    at small batch is latency-bound, so one fitted KV rate cannot hold from 16 tokens to long
    contexts; `rows_ms` is therefore anchored at `ref_kv_len` tokens of context per sequence
    (default: the profiled context nearest 1024, a typical prompt): rows_ms(n) = measured(n,
    ref) - seqs(n) * ref * kv_ms_per_token, exact at the reference and priced at the fitted
    rate around it. With `host_overhead`, each point also carries the engine's host time per
    round outside the executor (`time_engine_overhead`), so that predicted rounds are the
    engine's real round period. The profile's fields:

    - `target.rows_ms`: whole decode rounds (host batch build, graph replay of the target
      forward, acceptance, commit) by row bucket, so anchored; `target.rows_kv_ms`: the raw
      grid (rows, kv tokens per sequence, ms); `target.kv_read_TBps_assumed`: the effective KV
      read rate fitted from it (slope of round time over KV tokens), so the KV term
      `kv_tokens * kv_bytes_per_token / rate` is a measurement, not an assumption;
    - `target.prefill_rows_ms`: [rows, ms] whole rounds of prefill chunks (prompt starts of up
      to 1024 tokens, no decode rows), eager as such rounds run; flat below the fewest rows;
    - `target.spec_rows_ms`: [k, r, ms] rounds of k speculating sequences of r rows each (k
      over the powers of two up to the slots and the slots, r in 2, 4, 8 within the spec
      depth) at the reference context, the same KV-term subtraction and host time as rows_ms;
    - `target.ar_ahead_ratio`: [rows, ratio] the period of AR rounds run ahead over the round
      alone; `target.ar_restart_ms`: [c, ms] the first AR round after a speculating one beyond
      a steady AR round (the run-ahead pipeline restarts there);
    - `target.spec_round_ratio`: [k, ratio] full-depth speculating rounds as the engine runs
      them (prompts over half to 1.5 times the reference context) over the price the terms
      above give them; the cost model scales speculating rounds by it;
    - `draft_model.rows_ms_per_step`: one chain step of the draft model as a proposal pays it;
      `propose_ms`: [k, d, ms] a whole proposal of d drafts (1, 3, 7 within the spec depth) for
      k requests right after a verified round; `kv_ms_per_token`: what a proposal costs more
      per draft and per context token beyond `context_len`; `catchup_rows_ms`: [rows, ms] the
      draft model catching up whole prompts, with `catchup_rows_per_pass`,
      `max_catchup_passes`, `catchup_pass_rows` and `catchup_pass_buckets` for a graphed
      drafter's passes, by which the cost model prices catch-ups of any length;
    - `target.weight_bytes`, `draft_model.weight_bytes`, `block_drafter.weight_bytes`: the
      weights' bytes as the model holds them on the device (a quantized checkpoint's packed
      layers at their packed size; GGUF and, on a CPU, FP8 weights are dequantized at load);
    - `drafter_host`: a drafter without a model, its proposals' host time by requests;
    - `target.recurrent` (hybrid targets): the recurrent state's bytes per sequence and the
      journal's per SPEC row (`cost_profile.hybrid`), which the rounds above include;
    - `ceilings`: copy bandwidth and bf16 GEMM rate measured on the same device in the same run.
    """
    ex: RoundExecutor = engine.executor
    target = engine.target
    cfg = target.config
    timer = RoundTimer(ex, engine.config.spec_depth)
    max_rows = ex.max_slots * engine.config.spec_depth
    rows = tuple(r for r in rows if r <= max_rows and (r <= ex.max_slots or ex.drafter))
    # contexts the model can hold together with a round's rows
    kv_lens = tuple(k for k in kv_lens if k + engine.config.spec_depth <= engine.max_model_len)
    if not kv_lens:
        raise ValueError(f"no profiled context fits --max-model-len {engine.max_model_len}")
    grid = []
    for kv_len in kv_lens:
        for n in rows:
            need = -(-(kv_len + engine.config.spec_depth) // ex.block_size) * min(n, ex.max_slots)
            if need > ex.kv.num_blocks:
                continue
            grid.append([n, kv_len, round(timer.time_round(n, kv_len, repeats), 4)])
    elt = target.weights.embed.element_size()
    # the KV a round reads is in the cache's dtype (FP8: one byte), not the weights'
    kv_bytes = cfg.kv_bytes_per_token(target.kv_cache_dtype.itemsize)
    prefill_rows_ms = time_prefill_rows(
        timer, max(2, min(repeats, 5)), engine.config.max_prefill_tokens, engine.max_model_len
    )

    def num_seqs(n: int) -> int:  # RoundTimer's layout: AR rows up to the slots, then groups
        return -(-n // (1 if n <= ex.max_slots else -(-n // ex.max_slots)))

    # Effective KV read rate: per row count, slope of time over total KV tokens; median.
    rates = []
    for n in rows:
        pts = sorted((kv_len * num_seqs(n), ms) for m, kv_len, ms in grid if m == n)
        if len(pts) >= 2 and pts[-1][1] > pts[0][1]:
            dt_ms = pts[-1][1] - pts[0][1]
            rates.append((pts[-1][0] - pts[0][0]) * kv_bytes / (dt_ms * 1e-3) / 1e12)
    # When round time does not grow with context (tiny models, noise), the KV term is
    # negligible: a very high rate says so, and `kv_rate_fitted` records it.
    kv_rate = statistics.median(rates) if rates else 1e3
    kv_ms_per_token = kv_bytes / (float(f"{kv_rate:.4g}") * 1e12) * 1e3
    measured = {kv_len for _, kv_len, _ in grid}
    ref = min(measured, key=lambda k: abs(k - (ref_kv_len or 1024)))
    host_ms = time_engine_overhead(engine, host_points(ex.max_slots)) if host_overhead else []
    spec_host_ms = []
    ar_restart = []
    if host_overhead and engine.drafter is not None:
        spec_host_ms = time_engine_overhead(engine, host_points(ex.max_slots), spec_mode="spec")
        ar_restart = time_ar_restart(engine, host_points(ex.max_slots))
    # AR rounds run ahead (the engine's default): the host's build and commit hide behind the
    # device, so such a round costs its period, a fraction of the round alone measured above
    ahead_ratio = []
    if engine.config.overlap_rounds:
        alone = {n: ms for n, kv_len, ms in grid if kv_len == ref}
        for n in rows:
            if n <= ex.max_slots and n in alone:
                period = time_rounds_ahead(timer, n, ref, repeats)
                ahead_ratio.append([n, round(min(period / alone[n], 1.0), 4)])
    # (a noisy fit could price the reference context above the round itself: keep a floor)
    rows_ms = [
        [
            n,
            round(
                max(ms - num_seqs(n) * ref * kv_ms_per_token, 0.1 * ms)
                + _interp(host_ms, num_seqs(n)),
                4,
            ),
        ]
        for n, kv_len, ms in grid
        if kv_len == ref
    ]
    # speculating rounds as served: k sequences of r rows each, at the reference context, the
    # same KV-term subtraction and host time as rows_ms (by sequences)
    spec_depth = engine.config.spec_depth
    spec_counts = _spec_counts(ex.max_slots)
    spec_repeats = max(1, min(SPEC_REPEATS, repeats))
    spec_rows_ms = []
    if ex.drafter is not None:
        for k in spec_counts:
            if -(-(ref + spec_depth) // ex.block_size) * k > ex.kv.num_blocks:
                continue
            for r in _spec_rows_per_seq(spec_depth):
                ms = timer.time_round(k * r, ref, spec_repeats, rows_per_seq=r)
                ms = max(ms - k * ref * kv_ms_per_token, 0.1 * ms) + _interp(host_ms, k)
                spec_rows_ms.append([k, r, round(ms, 4)])
    device = target.device
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profile = {
        "name": f"{engine.model_name}-{dev_name.replace(' ', '-').lower()}",
        "device": f"{dev_name}, torch {torch.__version__}, measured {time.strftime('%Y-%m-%d')}",
        "method": (
            "whole decode rounds through RoundExecutor.run (host build, target forward with "
            "graph replay where enabled, acceptance, commit), median of repeats after warm-up; "
            f"KV rate fitted over contexts {list(kv_lens)}; rows_ms = the round at {ref} "
            "tokens of context per sequence minus that context's KV term"
            + (", plus the engine's host time per round (host_ms_per_round)" if host_ms else "")
            + (
                "; speculating rounds add the engine's host time around them "
                "(spec_host_ms_per_round, by decoding requests)"
                if spec_host_ms
                else ""
            )
            + (
                f"; spec_rows_ms: rounds of k speculating sequences of r rows at {ref} tokens "
                "of context, the same subtraction, median of "
                f"{spec_repeats}"
                if spec_rows_ms
                else ""
            )
        ),
        "ceilings": measure_ceilings(device) if with_ceilings else {},
        "target": {
            "shape": (
                f"{cfg.arch}: hidden {cfg.hidden_size}, intermediate "
                f"{cfg.intermediate_size}, {cfg.num_layers} layers, {cfg.num_q_heads} q "
                f"heads, {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}, vocab "
                f"{cfg.vocab_size}"
            ),
            "weight_bytes": target.weight_bytes,  # as held: packed layers at their size
            "rows_ms": rows_ms,
            "kv_bytes_per_token": kv_bytes,
            "kv_read_TBps_assumed": float(f"{kv_rate:.4g}"),
            "kv_rate_fitted": bool(rates),
            "rows_kv_ms": grid,
            "prefill_rows_ms": prefill_rows_ms,
            "spec_rows_ms": spec_rows_ms,
            "ref_kv_len": ref,
            "host_ms_per_round": host_ms,
            "spec_host_ms_per_round": spec_host_ms,
            "ar_ahead_ratio": ahead_ratio,
            "ar_restart_ms": ar_restart,
        },
    }
    if cfg.is_hybrid:  # state bytes per sequence and journal bytes per SPEC row
        profile["target"]["recurrent"] = recurrent_section(cfg, elt)
    draft_model = getattr(engine.drafter, "model", None)
    # (a synthetic drafter runs its inner drafter for the cost)
    inner = getattr(engine.drafter, "inner", engine.drafter)
    if inner is not None and draft_model is None and hasattr(inner, "propose"):
        # a drafter without a model costs host time in every speculating round
        profile["drafter_host"] = host_drafter_profile(
            copy.deepcopy(inner),  # its configuration, not its slots
            tuple(r for r in rows if r <= ex.max_slots),
            repeats,
            ref,
            cfg.vocab_size,
        )
    if isinstance(draft_model, BlockDraftModel):
        block, scheduled = block_drafter_sections(
            engine, draft_model, profile["target"], kv_lens, spec_counts, ref, spec_repeats
        )
        profile["block_drafter"], profile["draft_model"] = block, scheduled
        profile["target"] = with_context_write(profile["target"], block["context_write_ms"])
    elif draft_model is not None:
        profile["draft_model"] = draft_model_section(engine, draft_model, inner, rows, ref, repeats)
    if host_overhead and engine.drafter is not None:
        # the speculating terms above put together as the engine runs them (after them: the
        # ratio is against their price)
        profile["target"]["spec_round_ratio"] = time_spec_round_ratio(
            engine, profile, host_points(ex.max_slots), ref
        )
    return profile


def draft_model_section(
    engine: Engine, draft_model, inner, rows: tuple[int, ...], ref: int, repeats: int
) -> dict:
    """The profile's `draft_model` section of a draft model (a chain drafter) at the reference
    context `ref`: its chain step (at `rows` within the slots), whole proposals, catch-ups and
    draft KV growth, as `build_profile` documents them, with `inner` the drafter that runs it
    (its catch-up passes and wide buckets; it need not be the engine's own)."""
    ex = engine.executor
    spec_depth = engine.config.spec_depth
    spec_counts = _spec_counts(ex.max_slots)
    spec_repeats = max(1, min(SPEC_REPEATS, repeats))
    passes = getattr(inner, "catchup_rows_per_pass", 0)
    draft_rows = tuple(r for r in rows if r <= ex.max_slots)
    drafts = tuple(sorted({r - 1 for r in _spec_rows_per_seq(spec_depth)}))
    # one drafter for both timings (its slots caught up by the first)
    bench = draft_bench(
        draft_model,
        max(draft_rows + spec_counts),
        ref,
        max((7, *drafts)),
        table_width=ex.max_blocks_per_seq,
    )
    return {
        "shape": f"{draft_model.config.arch}: hidden {draft_model.config.hidden_size}, "
        f"{draft_model.config.num_layers} layers",
        "weight_bytes": draft_model.weight_bytes,  # as held: packed layers at their size
        # at the target's reference context: a step reads every drafting request's KV
        "rows_ms_per_step": time_draft_steps(
            draft_model, draft_rows, repeats, context_len=ref, bench=bench
        ),
        "context_len": ref,
        "note": "one chain step; a depth-D chain costs D-1 steps",
        # a whole proposal by (speculating requests, drafts), right after a verified round
        "propose_ms": time_draft_proposals(
            draft_model, spec_counts, drafts, spec_repeats, context_len=ref, bench=bench
        ),
        # catching up a whole prompt (after a prefill): one eager forward of its rows
        "catchup_rows_ms": time_draft_catchup(
            draft_model,
            catchup_profile_rows(engine.max_model_len),
            max(1, repeats // 2),
            rows_per_req=CATCHUP_PROMPT_ROWS,
        ),
        # proposals at longer contexts: the draft KV every step reads
        **_draft_kv_fields(
            draft_model, spec_counts, spec_depth, ref, engine, spec_repeats, ex, bench
        ),
        # a graphed drafter catches up in passes (DraftModelDrafter._step0)
        **(
            {
                "catchup_rows_per_pass": passes,
                "max_catchup_passes": getattr(inner, "max_catchup_passes", MAX_CATCHUP_PASSES),
            }
            if passes
            else {}
        ),
        # ... and runs longer ones in wide passes padded to these row buckets (_wide_rows)
        **(
            {
                "catchup_pass_rows": int(inner.wide_pass_rows),
                "catchup_pass_buckets": [int(b) for b in inner.wide_buckets],
            }
            if getattr(inner, "wide_buckets", ())
            else {}
        ),
    }
