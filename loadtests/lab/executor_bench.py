"""Round executor benchmark on a GPU: round time against the roofline, and GPU idle time in the
engine loop. Uses project internals (the executor and the engine), no HTTP.

    hipfire-bench executor --out docs/perf

Round time, two ways, on a random-weight Qwen3-8B-shaped model at about `--kv-len` tokens of
context per sequence: the engine's own loop at C = 1..256 greedy AR requests (wall time per
round with rounds launched ahead, everything between rounds included), and one round alone
(whole `RoundExecutor.run` calls: host build, graph replay, acceptance, commit) for AR rounds of
1..256 rows and speculative rounds of 8-row groups up to 512 rows. Roofline of a round =
max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate) with bytes = weights + KV read, FLOPs =
2 * params * rows + attention, both ceilings measured by this script on the same GPU; a hybrid
target's round also moves its recurrent state and journal (`cost_profile.hybrid`). GPU idle:
the engine loop at C concurrent decoding requests under a torch profiler; idle = 1 - (union of
kernel intervals) / wall time, split into gaps of >= 20 us (the device waiting for the host) and
shorter ones (between kernels launched back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

AR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPEC_ROWS = (64, 128, 256, 512)  # 8-row groups


def roofline_ms(
    engine, num_rows: int, kv_tokens: int, ceilings: dict, rows_per_seq: int = 1
) -> float:
    from hipfire_serve.cost_profile.hybrid import recurrent_round_bytes, recurrent_section

    cfg = engine.target.config
    elt = engine.target.weights.embed.element_size()
    weight_bytes = engine.target.num_params * elt
    kv_bytes = kv_tokens * cfg.kv_bytes_per_token(elt)
    if cfg.is_hybrid:  # the state read and written per sequence, the journal per row
        section = recurrent_section(cfg, elt)
        seqs = -(-num_rows // rows_per_seq)
        if rows_per_seq == 1:
            kv_bytes += recurrent_round_bytes(section, seqs)
        else:
            kv_bytes += recurrent_round_bytes(section, 0, [rows_per_seq] * seqs)
    dense_flops = 2 * engine.target.num_params * num_rows
    # q.k and p.v per row over its context (upper bound: every row sees the whole context)
    attn_flops = 4 * num_rows * (kv_tokens / max(num_rows, 1)) * cfg.q_size * cfg.num_layers
    t_bytes = (weight_bytes + kv_bytes) / (ceilings["copy_read_plus_write_TBps"] * 1e12)
    t_flops = (dense_flops + attn_flops) / (ceilings["bf16_gemm_TFLOPs"] * 1e12)
    return max(t_bytes, t_flops) * 1e3


def engine_loop(
    engine, concurrency: int, prompt_len: int, num_rounds: int, profile_idle: bool
) -> dict:
    """Runs `concurrency` greedy requests to steady decoding, then times `num_rounds` engine
    steps (wall ms per round, every round decoding all of them); with `profile_idle`, as many
    again under a CUDA-only profiler for the device's busy time."""
    from hipfire_serve.types import SamplingParams

    vocab = engine.target.config.vocab_size
    g = torch.Generator().manual_seed(concurrency)
    # enough tokens to outlast the prefill of the last arrivals (2 prompts per round at the
    # default budget) and the measured rounds; they are aborted at the end
    extra = concurrency * prompt_len // engine.config.max_prefill_tokens + 3 * num_rounds + 32
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)
    names = [f"loop-{concurrency}-{i}" for i in range(concurrency)]
    for name in names:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(name, prompt, params)
    while engine.scheduler.stats.num_prefilling or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    # Wall time without any profiler (its host-side recording would inflate it), then the
    # same number of rounds under a CUDA-only profiler for the device's busy time.
    t0 = time.perf_counter()
    for _ in range(num_rounds):
        engine.step()
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    rounds = engine.stats().rounds[-num_rounds:]
    phase_sums: dict[str, float] = {}
    for rs in rounds:
        for k, v in rs.phase_s.items():
            phase_sums[k] = phase_sums.get(k, 0.0) + v
    out = {
        "concurrency": concurrency,
        "rounds": num_rounds,
        "overlap_rounds": engine.config.overlap_rounds,
        "rows_per_round": statistics.mean(rs.num_rows for rs in rounds),
        "kv_tokens_per_round": statistics.mean(rs.num_kv_tokens for rs in rounds),
        "wall_ms_per_round": wall_s / num_rounds * 1e3,
        "executor_phase_ms_per_round": {
            k: round(v / num_rounds * 1e3, 4) for k, v in phase_sums.items()
        },
    }
    if profile_idle:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(num_rounds):
                engine.step()
            torch.cuda.synchronize()
        busy_us, gaps_us = _busy_us(prof)
        busy_s = busy_us / 1e6
        out["gpu_busy_ms_per_round"] = busy_s / num_rounds * 1e3
        out["gpu_idle_fraction"] = max(0.0, 1.0 - busy_s / wall_s)
        # Idle split by gap length: gaps under 20 us lie between kernels the device launches
        # back to back (inside a graph replay); longer ones are the device waiting for the host.
        long_gaps = sum(g for g in gaps_us if g >= 20.0) / 1e6
        out["gpu_idle_long_gaps_fraction"] = long_gaps / wall_s
        out["gpu_idle_short_gaps_fraction"] = sum(g for g in gaps_us if g < 20.0) / 1e6 / wall_s
        out["num_long_gaps_per_round"] = sum(1 for g in gaps_us if g >= 20.0) / num_rounds
    for name in names:
        engine.abort(name)
    while engine.has_unfinished():
        engine.step()
    return out


def _busy_us(prof) -> tuple[float, list[float]]:
    """Union of the device's kernel and copy intervals (us), and the gaps between them."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, cur_s, cur_e = 0.0, None, None
    gaps: list[float] = []
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy_us += cur_e - cur_s
                gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy_us += cur_e - cur_s
    return busy_us, gaps


def main(argv: list[str] | None = None) -> int:
    from executor.profiling.device import measure_ceilings
    from executor.profiling.rounds import RoundTimer
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    ap = argparse.ArgumentParser(prog="hipfire-bench executor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--idle-concurrency", type=int, default=64)
    ap.add_argument("--idle-rounds", type=int, default=40)
    ap.add_argument("--loop-concurrency", type=int, nargs="+", default=list(AR_ROWS), metavar="C")
    ap.add_argument("--loop-rounds", type=int, default=30)
    ap.add_argument("--ar-rows", type=int, nargs="*", default=list(AR_ROWS))
    ap.add_argument("--spec-rows", type=int, nargs="*", default=list(SPEC_ROWS))
    ap.add_argument("--spec-depth", type=int, default=8, help="rows of a speculative group")
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="48GiB")
    ap.add_argument("--graphs", default="lazy", help="lazy or off (a hybrid target has none)")
    ap.add_argument("--out", default="docs/perf")
    ap.add_argument("--name", default="executor", help="the record's file names: NAME.md, .json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("executor_bench: needs a CUDA/HIP GPU")
        return 2
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    engine = Engine(
        EngineConfig(
            model=args.model,
            draft="ngram",
            device="cuda",
            dtype="bfloat16",
            max_concurrency=args.max_concurrency,
            spec_depth=args.spec_depth,
            kv_cache_memory=args.kv_cache_memory,
            graphs=args.graphs,
            max_model_len=4096,
            spec_mode="ar",
        )
    )
    depth = args.spec_depth
    graphs = "on" if engine.executor.graphs is not None else "off"
    timer = RoundTimer(engine.executor, depth)
    rows_out = []
    for mode, rows, per_seq in [("ar", r, 1) for r in args.ar_rows] + [
        ("spec", r, depth) for r in args.spec_rows
    ]:
        ms = timer.time_round(r := rows, args.kv_len, args.repeats, rows_per_seq=per_seq)
        num_seqs = r // per_seq
        kv_tokens = num_seqs * args.kv_len
        roof = roofline_ms(engine, r, kv_tokens, ceilings, per_seq)
        rows_out.append(
            {
                "mode": mode,
                "rows": r,
                "seqs": num_seqs,
                "kv_tokens": kv_tokens,
                "round_ms": round(ms, 4),
                "roofline_ms": round(roof, 4),
                "ratio": round(ms / roof, 3),
                "phases_ms": {k: round(v, 4) for k, v in timer.last_phases.items()},
            }
        )
        print(
            f"{mode:>5} rows {r:>4} seqs {num_seqs:>4}: {ms:8.3f} ms  roofline "
            f"{roof:7.3f} ms  x{ms / roof:5.2f}  {rows_out[-1]['phases_ms']}",
            flush=True,
        )
    # Where the device time of one AR round of 64 rows (or the most measured) goes, by kernel.
    from torch.profiler import ProfilerActivity, profile

    profiled_rows = min(64, max(args.ar_rows, default=64))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timer.time_round(profiled_rows, args.kv_len, 3)
    kernel_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(kernel_table)
    # The engine's own loop: AR decode rounds of C requests back to back, rounds launched
    # ahead (overlap_rounds) so the host's work between rounds runs behind the device's.
    loop_rows = []
    for c in args.loop_concurrency:
        v = engine_loop(engine, c, args.kv_len, args.loop_rounds, profile_idle=False)
        rows, kv_tokens = round(v["rows_per_round"]), int(v["kv_tokens_per_round"])
        v["roofline_ms"] = round(roofline_ms(engine, rows, kv_tokens, ceilings), 4)
        v["ratio"] = round(v["wall_ms_per_round"] / v["roofline_ms"], 3)
        loop_rows.append(v)
        print(
            f"loop C {c:>4}: {v['wall_ms_per_round']:8.3f} ms/round  roofline "
            f"{v['roofline_ms']:7.3f} ms  x{v['ratio']:5.2f}",
            flush=True,
        )
    idle = {}
    for overlap in (True, False) if args.idle_concurrency else ():
        engine.config = engine.config.replace(overlap_rounds=overlap)
        idle["overlap" if overlap else "serial"] = engine_loop(
            engine, args.idle_concurrency, args.kv_len, args.idle_rounds, profile_idle=True
        )
    engine.config = engine.config.replace(overlap_rounds=True)
    record = {
        "gpu": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "model": args.model,
        "kv_len": args.kv_len,
        "spec_depth": depth,
        "graphs": graphs,
        "ceilings": ceilings,
        "rounds": rows_out,
        "engine_loop": loop_rows,
        "idle": idle,
        "kernel_table_ar64": kernel_table,
        "graph_memory_bytes": engine.executor.graphs.memory_bytes if engine.executor.graphs else 0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    worst = max((r["ratio"] for r in rows_out), default=float("nan"))
    worst_loop = max((r["ratio"] for r in loop_rows), default=float("nan"))
    lines = [
        "# Round executor: round time against the roofline",
        "",
        f"Measured on {record['gpu']}, {record['date']}, torch {record['torch']}, by "
        f"`hipfire-bench executor` (JSON: `{args.name}.json`), graphs {graphs}.",
        "",
        f"Ceilings measured in the same run: copy {ceilings['copy_read_plus_write_TBps']} TB/s "
        f"(read + write), bf16 GEMM {ceilings['bf16_gemm_TFLOPs']} TFLOP/s. Model "
        f"`{args.model}` (random bf16 weights), {args.kv_len} tokens of context per sequence.",
        "",
        "AR decode rounds in the engine's loop (scheduler plan and update, batch build, graph "
        f"replay, acceptance, commit; rounds launched ahead), {args.loop_rounds} rounds of C "
        "greedy requests, wall time per round; roofline at the run's mean context:",
        "",
        "| C | rows | wall ms/round | roofline ms | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['concurrency']} | {r['rows_per_round']:.0f} | {r['wall_ms_per_round']:.3f} | "
        f"{r['roofline_ms']:.3f} | {r['ratio']:.2f} |"
        for r in loop_rows
    ]
    lines += [
        "",
        f"Worst ratio in the loop: {worst_loop:.2f} (target <= 1.3).",
        "",
        "One round alone (`RoundExecutor.run`: launch, wait, commit; nothing overlaps it), AR "
        f"rows and speculative {depth}-row groups (the drafts cost nothing here):",
        "",
        "| mode | rows | seqs | round ms | roofline ms | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['rows']} | {r['seqs']} | {r['round_ms']:.3f} | "
        f"{r['roofline_ms']:.3f} | {r['ratio']:.2f} |"
        for r in rows_out
    ]
    lines += [
        "",
        f"Worst ratio of a round alone: {worst:.2f}.",
        "",
        "GPU idle in the engine loop (decode rounds, greedy AR), rounds launched ahead and "
        "one after the other:",
        "",
        "| C | rounds | wall ms/round | GPU busy ms/round | idle | in gaps >= 20 us "
        "(host) | in gaps < 20 us (between kernels) | gaps >= 20 us per round |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in idle.items():
        lines.append(
            f"| {v['concurrency']} | {name} | {v['wall_ms_per_round']:.3f} | "
            f"{v['gpu_busy_ms_per_round']:.3f} | {100 * v['gpu_idle_fraction']:.1f}% | "
            f"{100 * v['gpu_idle_long_gaps_fraction']:.1f}% | "
            f"{100 * v['gpu_idle_short_gaps_fraction']:.1f}% | "
            f"{v['num_long_gaps_per_round']:.1f} |"
        )
    lines += [
        "",
        f"Device time of a {profiled_rows}-row AR round by kernel (torch profiler, 3 rounds + "
        "warm-up):",
        "",
        "```",
        kernel_table.rstrip(),
        "```",
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
