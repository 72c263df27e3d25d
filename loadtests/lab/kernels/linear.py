"""Benchmark of the decode-size linear layers of Qwen3-8B (or of the Qwen3-0.6B-shaped draft
model) on one GPU: cuBLAS against the skinny Triton kernel; writes linear.json and linear.md
(linear-<model>.json/.md for another model) and prints the table.

    hipfire-bench linear --out DIR [--model qwen3-0.6b] [--rows 1,2,4] [--shapes qkv]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.skinny_linear import (
    MAX_ROWS,
    SkinnyConfig,
    fill_split,
    k_per_split,
    row_bucket,
    skinny_linear,
    wave_split,
)

# The method, shown under `--help`.
METHOD = """\
Per weight shape (qkv, o_proj, gate_up, down, lm_head; bf16) and row count it times
- `F.linear` (cuBLAS, torch's default library),
- `torch.mm(W, x^T)^T` (the same product with W as the left operand),
- `F.linear` with torch's preferred BLAS library set to cuBLASLt,
- for 1-16 rows, each candidate launch of `kernels.skinny_linear` (tiles x split-K, <= 12),
each as the median over graph replays of many back-to-back calls, the calls rotating over enough
copies of the weight that no call finds it in L2 (as in the model, where each layer has its
own). Weight bandwidth is weight bytes over the time, set against the copy bandwidth (bytes read
plus written by a large device-to-device copy) measured in the same run. Every variant is
checked against `F.linear` (max abs error over max abs value, < 1e-2). The record's
`table_entries` are the kernel's best launches where they beat every torch variant, in the
form of `kernels.skinny_linear.TUNED`; the projection sums one decode forward's linear layers
(layers x 4 shapes + lm_head) with cuBLAS and with the best variant per shape.
Triton variants are compiled first in worker processes (Triton's on-disk cache), so the timing
process only loads binaries.
"""


# name -> (N, K) of Qwen3-8B (hidden 4096, 32 q heads + 2 x 8 kv heads of 128, intermediate
# 12288, vocabulary 151936)
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
NUM_LAYERS = 36
# model -> (shapes, layers); Qwen3-0.6B: hidden 1024, 16 q heads + 2 x 8 kv heads of 128,
# intermediate 3072, the same vocabulary
MODELS: dict[str, tuple[dict[str, tuple[int, int]], int]] = {
    "qwen3-8b": (SHAPES, NUM_LAYERS),
    "qwen3-0.6b": (
        {
            "qkv": (4096, 1024),
            "o_proj": (1024, 2048),
            "gate_up": (6144, 1024),
            "down": (1024, 3072),
            "lm_head": (151936, 1024),
        },
        28,
    ),
}
ROWS = (1, 2, 4, 8, 16, 32, 64)
# (block_n, block_k, num_warps, num_stages) of the candidate launches
DOT_TILES = ((64, 256, 4, 3), (64, 128, 4, 4), (128, 256, 8, 3))
FMA_TILES = ((32, 256, 4, 2),)
DTYPE = torch.bfloat16
MAX_REL_ERR = 1e-2
ROTATE_BYTES = 256 << 20  # weight copies per shape: > H200's 50 MB L2 several times over
REPLAY_MS = 3.0  # target kernel time per graph replay
NUM_REPLAYS = 10


def _splits(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> list[int]:
    """Powers of two from half to twice the split that puts a program on every SM."""
    fill = fill_split(n, k, block_n, block_k, num_sms)
    return [s for s in (1, 2, 4, 8, 16, 32) if fill <= 2 * s <= 4 * fill and k // s >= block_k]


def candidates(n: int, k: int, num_rows: int, num_sms: int) -> list[SkinnyConfig]:
    """The sweep for one shape: dot tiles (two of them when fp32 multiply-add tiles also run)
    at power-of-two splits from half to twice the one that fills the SMs, split-K reduced by
    each tile's last split; and the first tile at the split of the fullest last wave reduced
    by the second kernel."""
    if num_rows > MAX_ROWS:
        return []
    use_fma = num_rows <= 2
    dot_tiles = DOT_TILES[:2] if use_fma else DOT_TILES
    out = []
    for tiles, use_dot in ((dot_tiles, True), (FMA_TILES if use_fma else (), False)):
        for block_n, block_k, warps, stages in tiles:
            for split in _splits(n, k, block_n, block_k, num_sms):
                out.append(SkinnyConfig(block_n, block_k, split, warps, stages, use_dot))
    block_n, block_k, warps, stages = DOT_TILES[0]
    split = wave_split(n, k, block_n, block_k, num_sms)
    if split > 1:
        out.append(SkinnyConfig(block_n, block_k, split, warps, stages, True, False))
    return out


# ---------------------------------------------------------------- parallel compilation


def _compile_task(task: tuple[SkinnyConfig, int, int, int]) -> str | None:
    """Launches one variant once on a stand-in weight of the same K and alignment."""
    cfg, k, num_rows, _ = task
    try:
        dev = torch.device("cuda")
        n = 2 * cfg.block_n
        x = torch.zeros((num_rows, k), dtype=torch.bfloat16, device=dev)  # [M, K]
        w = torch.zeros((n, k), dtype=torch.bfloat16, device=dev)  # [N, K]
        # The real shape's split count (a constexpr of the reduction): forced by the same K.
        skinny_linear(x, w, None, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported; the timing process compiles it again
        return f"{cfg.name} K={k} M={num_rows}: {type(exc).__name__}: {exc}"[:300]


def compile_all(tasks: list[tuple[SkinnyConfig, int, int, int]], workers: int) -> list[str]:
    """Distinct compilations only: rows matter only as the fma block (1 or 2) or not at all."""
    seen, unique = set(), []
    for cfg, k, num_rows, n in tasks:
        block_m = 16 if cfg.use_dot else num_rows
        num_splits = math.ceil(k / k_per_split(k, cfg.block_k, cfg.split_k))
        key = (
            cfg.block_n,
            cfg.block_k,
            cfg.num_warps,
            cfg.num_stages,
            cfg.use_dot,
            cfg.last_reduces,
            block_m,
            num_splits,
            k % k_per_split(k, cfg.block_k, cfg.split_k) == 0,
        )
        if key not in seen:
            seen.add(key)
            unique.append((cfg, k, num_rows, n))
    from loadtests.lab.kernels import (
        linear as bench_linear,  # pickled by module path, also when run as __main__
    )

    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            errors = [e for e in pool.map(bench_linear._compile_task, unique) if e]
    except Exception as exc:  # the timing process compiles on first use instead
        errors = [f"worker pool: {type(exc).__name__}: {exc}"[:300]]
    print(f"compiled {len(unique)} variants in {workers} workers, {len(errors)} errors")
    return errors


# ---------------------------------------------------------------- timing


def time_calls(call, num_copies: int, calls: int) -> float:
    """Median microseconds per call over graph replays of `calls` calls (call(i) uses weight
    copy i % num_copies)."""
    call(0)  # compiles / initialises outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, num_copies)):  # warm-up on a side stream before capture
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % num_copies)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(NUM_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth_tbps() -> float:
    """Bytes read + written per second by a device-to-device copy, TB/s: the same ceiling the
    other benchmarks use (`executor.profiling.device.measure_ceilings`). A copy captured in a graph
    becomes a memcpy node, which measured 2.77 TB/s on the H200 against 4.16 for the kernel."""
    from executor.profiling.device import measure_ceilings

    return measure_ceilings(torch.device("cuda"))["copy_read_plus_write_TBps"]


def torch_variants() -> dict[str, object]:
    def mm_t(x, w):
        return torch.mm(w, x.t()).t()  # [N, M] -> [M, N] view

    out = {"F.linear": F.linear, "mm(W,x^T)^T": mm_t}
    if hasattr(torch.backends.cuda, "preferred_blas_library"):

        def lt(x, w):
            return F.linear(x, w)

        lt.blas = "cublaslt"
        out["F.linear[cublaslt]"] = lt
    return out


@dataclass(frozen=True)
class _Case:
    x: torch.Tensor  # [M, K]
    weights: list[torch.Tensor]  # copies of [N, K]
    ref: torch.Tensor  # [M, N] fp32, F.linear on weights[0]
    calls: int  # calls per graph replay
    weight_bytes: int
    copy_bw: float  # TB/s


def _skinny(x, w, cfg):
    return skinny_linear(x, w, None, cfg)


def time_variant(case: _Case, label: str, fn, blas: str | None = None, cfg=None) -> dict:
    """Error against F.linear and median time of one variant; an exception is recorded."""
    prev = torch.backends.cuda.preferred_blas_library() if blas else None
    try:
        if blas:
            torch.backends.cuda.preferred_blas_library(blas)
        out = fn(case.x, case.weights[0]).float()  # [M, N]
        err = (out - case.ref).abs().max().item() / case.ref.abs().max().item()
        weights, x = case.weights, case.x
        us = time_calls(lambda i: fn(x, weights[i]), len(weights), case.calls)
        tbps = case.weight_bytes / (us * 1e-6) / 1e12
        return {
            "variant": label,
            "us": round(us, 2),
            "tbps": round(tbps, 3),
            "of_copy_bw": round(tbps / case.copy_bw, 3),
            "rel_err": err,
            "ok": err < MAX_REL_ERR,
            "config": None if cfg is None else dataclasses.asdict(cfg),
        }
    except Exception as exc:
        return {"variant": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        if blas:
            torch.backends.cuda.preferred_blas_library(prev)


def bench_shape(
    name: str,
    n: int,
    k: int,
    rows: tuple[int, ...],
    num_sms: int,
    copy_bw: float,
    gen: torch.Generator,
) -> list[dict]:
    weight_bytes = n * k * 2
    num_copies = max(1, math.ceil(ROTATE_BYTES / weight_bytes))
    weights = [
        (torch.randn((n, k), generator=gen, device=gen.device) * 0.02).to(DTYPE)
        for _ in range(num_copies)
    ]  # num_copies x [N, K]
    est_us = weight_bytes / (copy_bw * 0.9e12) * 1e6
    calls = int(min(64, max(4, round(REPLAY_MS * 1000 / est_us))))
    records = []
    for num_rows in rows:
        x = torch.randn((num_rows, k), generator=gen, device=gen.device).to(DTYPE)  # [M, K]
        ref = F.linear(x, weights[0]).float()  # [M, N]

        case = _Case(x, weights, ref, calls, weight_bytes, copy_bw)
        variants = [
            time_variant(case, label, fn, getattr(fn, "blas", None))
            for label, fn in torch_variants().items()
        ]
        variants += [
            time_variant(case, cfg.name, functools.partial(_skinny, cfg=cfg), cfg=cfg)
            for cfg in candidates(n, k, num_rows, num_sms)
        ]
        timed = [v for v in variants if v.get("ok")]
        best = min(timed, key=lambda v: v["us"]) if timed else None
        torch_timed = [v for v in timed if v["config"] is None]
        best_torch = min(torch_timed, key=lambda v: v["us"]) if torch_timed else None
        ours = [v for v in timed if v["config"] is not None]
        best_ours = min(ours, key=lambda v: v["us"]) if ours else None
        cublas = next((v for v in variants if v["variant"] == "F.linear" and "us" in v), None)
        rec = {
            "shape": name,
            "n": n,
            "k": k,
            "rows": num_rows,
            "weight_bytes": weight_bytes,
            "weight_copies": num_copies,
            "calls_per_replay": calls,
            "cublas_us": cublas["us"] if cublas else None,
            "best": best["variant"] if best else None,
            "best_us": best["us"] if best else None,
            "best_torch": best_torch["variant"] if best_torch else None,
            "best_torch_us": best_torch["us"] if best_torch else None,
            "best_skinny": best_ours["variant"] if best_ours else None,
            "best_skinny_us": best_ours["us"] if best_ours else None,
            "best_skinny_config": best_ours["config"] if best_ours else None,
            "variants": variants,
        }
        records.append(rec)
        print(_row(rec, copy_bw), flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------- report

_HEADER = (
    "| shape | rows | F.linear us | mm^T us | cuBLASLt us | best skinny | skinny us | "
    "best TB/s | of copy | best vs F.linear |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _us(rec: dict, label: str) -> str:
    v = next((v for v in rec["variants"] if v["variant"] == label and "us" in v), None)
    return f"{v['us']:.1f}" if v else "-"


def _row(rec: dict, copy_bw: float) -> str:
    best_us = rec["best_us"]
    tbps = rec["weight_bytes"] / (best_us * 1e-6) / 1e12 if best_us else float("nan")
    speed = rec["cublas_us"] / best_us if best_us and rec["cublas_us"] else float("nan")
    skinny = rec["best_skinny"] or "-"
    skinny_us = f"{rec['best_skinny_us']:.1f}" if rec["best_skinny_us"] else "-"
    return (
        f"| {rec['shape']} | {rec['rows']} | {_us(rec, 'F.linear')} | {_us(rec, 'mm(W,x^T)^T')} "
        f"| {_us(rec, 'F.linear[cublaslt]')} | {skinny} | {skinny_us} | {tbps:.2f} "
        f"| {tbps / copy_bw:.0%} | {speed:.2f}x |"
    )


def projection(
    records: list[dict],
    rows: tuple[int, ...],
    shapes: dict[str, tuple[int, int]] = SHAPES,
    num_layers: int = NUM_LAYERS,
) -> list[dict]:
    """One decode forward's linear layers: layers x (qkv + o_proj + gate_up + down) + lm_head."""
    out = []
    for num_rows in rows:
        by_shape = {r["shape"]: r for r in records if r["rows"] == num_rows}
        if set(by_shape) != set(shapes) or any(
            by_shape[s]["cublas_us"] is None or by_shape[s]["best_us"] is None for s in shapes
        ):
            continue
        weight = {s: (1 if s == "lm_head" else num_layers) for s in shapes}
        cublas = sum(weight[s] * by_shape[s]["cublas_us"] for s in shapes)
        best = sum(weight[s] * by_shape[s]["best_us"] for s in shapes)
        total_bytes = sum(weight[s] * by_shape[s]["weight_bytes"] for s in shapes)
        out.append(
            {
                "rows": num_rows,
                "cublas_us": round(cublas, 1),
                "best_of_us": round(best, 1),
                "saved_us": round(cublas - best, 1),
                "weight_gb": round(total_bytes / 1e9, 3),
            }
        )
    return out


def table_entries(records: list[dict]) -> list[dict]:
    """Best skinny launch per (N, K, row bucket) where it beats every torch variant."""
    out = []
    for rec in records:
        if rec["rows"] > MAX_ROWS or rec["rows"] != row_bucket(rec["rows"]):
            continue
        if rec["best_skinny_us"] is None or rec["best_torch_us"] is None:
            continue
        if rec["best_skinny_us"] < rec["best_torch_us"]:
            out.append(
                {
                    "n": rec["n"],
                    "k": rec["k"],
                    "rows": rec["rows"],
                    "config": rec["best_skinny_config"],
                    "skinny_us": rec["best_skinny_us"],
                    "torch_us": rec["best_torch_us"],
                }
            )
    return out


def tuned_snippet(entries: list[dict]) -> list[str]:
    """Lines of `TUNED` dict items for the table entries."""
    out = []
    for e in entries:
        c = e["config"]
        out.append(
            f"    ({e['n']}, {e['k']}, {e['rows']}): SkinnyConfig({c['block_n']}, {c['block_k']}, "
            f"{c['split_k']}, {c['num_warps']}, {c['num_stages']}, {c['use_dot']}, "
            f"{c['last_reduces']}),"
            f"  # {e['skinny_us']} us vs {e['torch_us']} us"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prog="hipfire-bench linear",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args(argv)
    rows = tuple(int(r) for r in args.rows.split(","))
    model_shapes, num_layers = MODELS[args.model]
    unknown = sorted(set(args.shapes.split(",")) - set(model_shapes))
    if unknown:
        parser.error(f"unknown shapes {', '.join(unknown)} (choose from {', '.join(SHAPES)})")
    shapes = {s: model_shapes[s] for s in args.shapes.split(",")}
    stem = "linear" if args.model == "qwen3-8b" else f"linear-{args.model}"
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    num_sms = props.multi_processor_count
    tasks = [
        (cfg, k, m, n)
        for (n, k) in shapes.values()
        for m in rows
        for cfg in candidates(n, k, m, num_sms)
    ]
    compile_errors = compile_all(tasks, args.workers) if tasks else []
    t_compiled = time.time()
    copy_bw = copy_bandwidth_tbps()
    print(
        f"{props.name}: {num_sms} SMs, copy bandwidth {copy_bw:.2f} TB/s "
        f"(compile {t_compiled - t0:.1f} s)"
    )
    print(_HEADER)
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for name, (n, k) in shapes.items():
        records += bench_shape(name, n, k, rows, num_sms, copy_bw, gen)
    proj = projection(records, rows, shapes, num_layers)
    for p in proj:
        print(
            f"decode forward linears at {p['rows']} rows: cuBLAS {p['cublas_us']:.0f} us, "
            f"best-of {p['best_of_us']:.0f} us (saves {p['saved_us']:.0f} us; "
            f"roofline {p['weight_gb'] / copy_bw * 1e3:.0f} us at copy bandwidth)"
        )
    record = {
        "device": props.name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "num_sms": num_sms,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_bw_tbps": round(copy_bw, 3),
        "compile_errors": compile_errors,
        "wall_s": round(time.time() - t0, 1),
        "compile_s": round(t_compiled - t0, 1),
        "projection": proj,
        "table_entries": table_entries(records),
        "records": records,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# Linear layers of {args.model} at decode sizes, {props.name}, {record['date']}",
        f"Copy bandwidth {copy_bw:.2f} TB/s; weights bf16; times are medians of CUDA-graph "
        "replays (us per call).",
        "",
        _HEADER,
    ]
    lines += [_row(r, copy_bw) for r in records]
    lines += ["", "| rows | cuBLAS us | best-of us | saved us |", "|---|---|---|---|"]
    lines += [
        f"| {p['rows']} | {p['cublas_us']} | {p['best_of_us']} | {p['saved_us']} |" for p in proj
    ]
    entries = record["table_entries"]
    lines += [
        "",
        "`kernels.skinny_linear.TUNED` entries (the kernel's wins over every torch variant):",
        "",
        "```python",
        *tuned_snippet(entries),
        "```",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(tuned_snippet(entries)))
    print(f"wall {time.time() - t0:.1f} s; wrote {args.out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
