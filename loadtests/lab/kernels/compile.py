"""Compiles the benchmark's kernel variants in parallel worker processes before it times them.

Triton compiles a variant on its first launch, and the benchmark launches about a hundred (each
shape has its own split count and tile constants), which one at a time costs minutes of GPU
time. Each worker launches some variants once on a stand-in batch: the same tile settings,
constants and integer arguments as the timed batch, so Triton specialises it the same way, but
over a one-page cache. That fills Triton's on-disk cache; the timing process then only loads the
binaries. A variant that fails here is reported and compiled again by the timing process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import time

import torch

from kernels import arch
from kernels.attention import verify_attention
from loadtests.lab.kernels import common


@dataclasses.dataclass(frozen=True)
class CompileTask:
    kind: str  # "attention" or "small" (every small-kernel case)
    tiles: tuple[tuple[str, int], ...] = ()  # the full AttentionTiles entry to launch with
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # batch, ctx, rows per sequence, GQA
    per_row: bool = False


def stand_in_batch(device: torch.device, batch: int, ctx: int, rows: int, gqa: int):
    """(q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables) shaped and strided as
    `common.KvPool.batch` makes them, with every page pointing at the cache's single block."""
    q = torch.zeros(batch * rows, common.NUM_KV_HEADS * gqa, common.HEAD_DIM, dtype=torch.bfloat16)
    cache_shape = (1, common.PAGE_SIZE, common.NUM_KV_HEADS, common.HEAD_DIM)
    k_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
    v_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
    cu = torch.arange(0, batch + 1, dtype=torch.int32) * rows
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    block_tables = torch.zeros((batch, ctx // common.PAGE_SIZE), dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, cu, seq_lens, block_tables))


def _run_task(task: CompileTask) -> str | None:
    """Launches the task's variants once; returns an error line or None."""
    try:
        device = torch.device("cuda")
        if task.kind == "small":
            for _, ours, _, _ in common.small_kernel_cases(device):
                ours()
        else:
            common.set_attention_tiles(device, **dict(task.tiles))
            batch = stand_in_batch(device, *task.shape)
            tiling = {"rows_per_tile": 1} if task.per_row else {"max_q_len": task.shape[2]}
            verify_attention(*batch, 1.0 / math.sqrt(common.HEAD_DIM), **tiling)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported; the timing process compiles it again
        return f"{task}: {type(exc).__name__}: {exc}"[:300]


def compile_tasks(
    tiles: arch.AttentionTiles,
    shapes: list[tuple[int, int, int, int]],
    sweep: list[tuple[dict, tuple]],
    small: bool,
) -> list[CompileTask]:
    """The grid's variants (ours and per-row) under `tiles`, then the sweep's (changes to
    `tiles`, each on its own shapes), without repeats."""
    tasks = [CompileTask("small")] if small else []  # the longest task goes first
    base = tuple(sorted(dataclasses.asdict(tiles).items()))
    for shape in shapes:
        tasks += [CompileTask("attention", base, shape, per_row) for per_row in (False, True)]
    for changes, sweep_shapes in sweep:
        changed = dataclasses.replace(tiles, **changes)
        items = tuple(sorted(dataclasses.asdict(changed).items()))
        tasks += [CompileTask("attention", items, shape) for shape in sweep_shapes]
    return list(dict.fromkeys(tasks))


def compile_all(
    device: torch.device,
    shapes: list[tuple[int, int, int, int]],
    sweep: list[tuple[dict, tuple]],
    small: bool,
) -> dict:
    """Compiles every variant the run will time; returns counts, wall seconds and errors."""
    tasks = compile_tasks(arch.arch_config(device).attention, shapes, sweep, small)
    start = time.perf_counter()
    num_workers = max(1, min(len(tasks), (os.cpu_count() or 2) - 1, 16))
    errors: list[str] = []
    try:
        with multiprocessing.get_context("spawn").Pool(num_workers) as pool:
            errors = [e for e in pool.imap_unordered(_run_task, tasks, chunksize=1) if e]
    except Exception as exc:  # no worker pool: the timing process compiles as it goes
        errors.append(f"pool: {type(exc).__name__}: {exc}"[:300])
    return {
        "num_tasks": len(tasks),
        "num_workers": num_workers,
        "seconds": round(time.perf_counter() - start, 1),
        "errors": errors[:10],
    }


def main(argv: list[str] | None = None) -> int:
    """Fills Triton's cache ahead of `hipfire-bench kernels --tune`: the first sweep phase's
    variants (relative to the arch-table entry as committed), e.g. while GPU tests run."""
    ap = argparse.ArgumentParser(
        prog="hipfire-bench kernels-compile", description=main.__doc__.splitlines()[0]
    )
    ap.add_argument("--phase", type=int, default=0, help="sweep phase to compile")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    phase = common.SWEEP_PHASES[args.phase]
    print(json.dumps(compile_all(device, [], common.sweep_tasks(phase), small=False)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
