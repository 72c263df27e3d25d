"""A block drafter's part of the cost profile (`block_drafter_sections`), in the format the
scheduler's cost model already prices, and the context write it adds to every round.

A block drafter's proposal is one forward of every speculating request's block whatever the
depth, plus the logits and picks of the drafts verified; it has no chain steps and never lags
(every target forward writes its context). So its `draft_model` section is: `propose_ms`
[k, d, ms], block proposals at the reference context (the cost model's proposal table); a
chain step of 0 ms (drafts past the table, and catch-ups, add nothing); catch-up passes longer
than any context (no lag is priced as a forward of its own). The context write (fc and k/v
projections of every row of a target forward, and their paged store) is paid by every round,
AR and prefill ones too: it is added to the target's round curves (`with_context_write`:
rows_ms, spec_rows_ms, prefill_rows_ms; rows_kv_ms stays the target alone). The raw
measurements are the `block_drafter` section.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import numpy as np

from executor.drafters.block_model import BlockDraftModel
from executor.profiling.blocks import (
    standalone_block_drafter,
    time_block_proposals,
    time_context_write,
)

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine


def block_drafts(spec_depth: int) -> tuple[int, ...]:
    """Drafts per request profiled: 1, 3, 7 and the deepest, within the spec depth."""
    return tuple(sorted({min(d, spec_depth - 1) for d in (1, 3, 7, spec_depth - 1)} - {0}))


def _write_rows(target: dict) -> tuple[int, ...]:
    """Row counts of the target's round curves, where the context write is timed."""
    rows = {int(n) for n, _ in target.get("rows_ms") or []}
    rows |= {int(n) for n, _ in target.get("prefill_rows_ms") or []}
    rows |= {int(k * r) for k, r, _ in target.get("spec_rows_ms") or []}
    return tuple(sorted(rows)) or (1,)


def _kv_slope(points: list[list[float]], drafts: int) -> float:
    """ms per request per context token of the deepest proposals between the shortest and the
    longest context, the median over the request counts of 4 and more (all where none is);
    never below 0. The context every block attends to grows a proposal per request, not per
    draft."""
    by_kc = {(k, c): ms for k, c, d, ms in points if d == drafts}
    contexts = sorted({c for _, c in by_kc})
    if len(contexts) < 2:
        return 0.0
    lo, hi = contexts[0], contexts[-1]
    counts = sorted({k for k, _ in by_kc})
    counts = [k for k in counts if k >= 4] or counts
    slopes = [(by_kc[k, hi] - by_kc[k, lo]) / (k * (hi - lo)) for k in counts]
    return float(f"{max(statistics.median(slopes), 0.0):.4g}")


def block_drafter_sections(
    engine: Engine,
    model: BlockDraftModel,
    target: dict,
    kv_lens: tuple[int, ...],
    spec_counts: tuple[int, ...],
    ref: int,
    repeats: int,
) -> tuple[dict, dict]:
    """Measures the block drafter `model` on a drafter of its own (`standalone_block_drafter`):
    proposals by (speculating requests in `spec_counts`, contexts of `kv_lens` and twice the
    reference `ref`, drafts of `block_drafts`) and its context write at the row counts of
    `target`'s curves.
    -> (`block_drafter` section, `draft_model` section in the cost model's format)"""
    cfg = model.config
    spec_depth = engine.config.spec_depth
    drafts = block_drafts(spec_depth)
    # the profiled contexts and twice the reference one, where a block past them still fits
    reach = min(engine.max_model_len, model.decoder.max_position) - cfg.block_size
    contexts = tuple(sorted({c for c in kv_lens if c <= reach} | {min(2 * ref, reach)}))
    drafter = standalone_block_drafter(model, max(spec_counts), max(contexts))
    vocab = cfg.decoder.vocab_size
    proposals = time_block_proposals(drafter, spec_counts, drafts, contexts, repeats, vocab)
    write = time_context_write(drafter, _write_rows(target), repeats)
    dec = cfg.decoder
    shape = (
        f"{dec.arch}: hidden {dec.hidden_size}, intermediate {dec.intermediate_size}, "
        f"{dec.num_layers} layers, {dec.num_q_heads} q heads, {dec.num_kv_heads} kv heads, "
        f"head_dim {dec.head_dim}, block {cfg.block_size}, target layers "
        f"{list(cfg.target_layer_ids)}"
    )
    block = {
        "shape": shape,
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        # its own weights as held (packed layers at their size; embedding and lm_head: target's)
        "weight_bytes": model.weight_bytes,
        "context_len": ref,
        # whole proposals: one forward of k blocks at c tokens of context, d drafts' logits
        "propose_ms": proposals,
        # one target forward's rows written to the drafter's context
        "context_write_ms": write,
        "kv_ms_per_token": _kv_slope(proposals, drafts[-1]),
        "context_in_target": True,
        "note": (
            "propose_ms [k, context, drafts, ms]: BlockDrafter.propose for k requests; "
            "kv_ms_per_token: per request and context token; context_write_ms [rows, ms]: "
            "extend_context, added to target rows_ms, spec_rows_ms and prefill_rows_ms"
        ),
    }
    at_ref = [[k, d, ms] for k, c, d, ms in proposals if c == ref]
    if not at_ref:  # (the reference context is one of kv_lens: the nearest one otherwise)
        nearest = min(contexts, key=lambda c: abs(c - ref))
        at_ref = [[k, d, ms] for k, c, d, ms in proposals if c == nearest]
    scheduled = {
        "kind": "block",
        "shape": shape,
        "rows_ms_per_step": [[1, 0.0], [max(2, engine.executor.max_slots), 0.0]],
        "context_len": ref,
        "propose_ms": at_ref,
        "catchup_rows_per_pass": engine.max_model_len + cfg.block_size,
        "max_catchup_passes": 1,
        "note": (
            "a block drafter: one forward per round whatever the depth (propose_ms), no chain "
            "steps, no catch-up; its context write is in the target's curves"
        ),
    }
    return block, scheduled


def with_context_write(target: dict, write_ms: list[list[float]], sign: float = 1.0) -> dict:
    """`target` (a profile's section) with the context write of every round's rows added
    (`sign` -1: taken off again) to rows_ms, spec_rows_ms and prefill_rows_ms; linear in rows
    between the `write_ms` [rows, ms] points, flat outside them."""
    pts = np.asarray(write_ms, dtype=np.float64).reshape(-1, 2)

    def plus(rows: float, ms: float) -> float:
        return round(ms + sign * float(np.interp(rows, pts[:, 0], pts[:, 1])), 4)

    out = dict(target)
    out["rows_ms"] = [[n, plus(n, ms)] for n, ms in target.get("rows_ms") or []]
    out["prefill_rows_ms"] = [[n, plus(n, ms)] for n, ms in target.get("prefill_rows_ms") or []]
    out["spec_rows_ms"] = [[k, r, plus(k * r, ms)] for k, r, ms in target.get("spec_rows_ms") or []]
    return out


def target_only(profile: dict) -> dict:
    """`profile` less its drafter's terms, as another drafter in the same engine is priced
    from it (the benchmark's cost drafters share one engine): no drafter sections and no round
    factor (both the other drafter's to measure), and a block drafter's context write taken
    off the target's curves again."""
    block = profile.get("block_drafter")
    drop = ("block_drafter", "draft_model", "drafter_host")
    out = {k: v for k, v in profile.items() if k not in drop}
    target = {k: v for k, v in profile["target"].items() if k != "spec_round_ratio"}
    if block and block.get("context_in_target"):
        target = with_context_write(target, block["context_write_ms"], -1.0)
    out["target"] = target
    return out
