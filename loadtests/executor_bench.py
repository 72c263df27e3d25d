"""Round executor benchmark on a GPU: round time against the roofline, and GPU idle time in the
engine loop. Uses project internals (the executor and the engine), no HTTP.

    python -m loadtests.executor_bench --out docs/perf

Round time: whole `RoundExecutor.run` calls (host build, graph replay of the target forward,
acceptance, commit) for AR rounds of 1..256 rows and speculative rounds of 8-row groups up to
512 rows, each at a context of `--kv-len` tokens per sequence, on a random-weight Qwen3-8B-shaped
model. Roofline of a round = max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate) with
bytes = weights + KV read, FLOPs = 2 * params * rows + attention, both ceilings measured by this
script on the same GPU. GPU idle: the engine loop at C concurrent decoding requests under a
torch profiler; idle = 1 - (union of kernel intervals) / wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

AR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPEC_ROWS = (64, 128, 256, 512)  # 8-row groups


def roofline_ms(engine, num_rows: int, kv_tokens: int, ceilings: dict) -> float:
    cfg = engine.target.config
    elt = engine.target.weights.embed.element_size()
    weight_bytes = engine.target.num_params * elt
    kv_bytes = kv_tokens * cfg.kv_bytes_per_token(elt)
    dense_flops = 2 * engine.target.num_params * num_rows
    # q.k and p.v per row over its context (upper bound: every row sees the whole context)
    attn_flops = 4 * num_rows * (kv_tokens / max(num_rows, 1)) * cfg.q_size * cfg.num_layers
    t_bytes = (weight_bytes + kv_bytes) / (ceilings["copy_read_plus_write_TBps"] * 1e12)
    t_flops = (dense_flops + attn_flops) / (ceilings["bf16_gemm_TFLOPs"] * 1e12)
    return max(t_bytes, t_flops) * 1e3


def gpu_idle_fraction(engine, concurrency: int, prompt_len: int, num_rounds: int) -> dict:
    """Runs `concurrency` requests to steady decoding, then profiles `num_rounds` rounds."""
    from hipfire_serve.types import SamplingParams

    vocab = engine.target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=num_rounds * 16 + 64, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"idle-{i}", prompt, params)
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
    phase_sums: dict[str, float] = {}
    for rs in engine.stats().rounds[-num_rounds:]:
        for k, v in rs.phase_s.items():
            phase_sums[k] = phase_sums.get(k, 0.0) + v
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_rounds):
            engine.step()
        torch.cuda.synchronize()
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy_us += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy_us += cur_e - cur_s
    for i in range(concurrency):
        engine.abort(f"idle-{i}")
    while engine.has_unfinished():
        engine.step()
    busy_s = busy_us / 1e6
    return {
        "concurrency": concurrency,
        "rounds": num_rounds,
        "wall_ms_per_round": wall_s / num_rounds * 1e3,
        "gpu_busy_ms_per_round": busy_s / num_rounds * 1e3,
        "gpu_idle_fraction": max(0.0, 1.0 - busy_s / wall_s),
        "executor_phase_ms_per_round": {
            k: round(v / num_rounds * 1e3, 4) for k, v in phase_sums.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    from executor.profiler import RoundTimer, measure_ceilings
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--idle-concurrency", type=int, default=64)
    ap.add_argument("--idle-rounds", type=int, default=40)
    ap.add_argument("--out", default="docs/perf")
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
            max_concurrency=256,
            spec_depth=8,
            kv_cache_memory="48GiB",
            graphs="lazy",
            max_model_len=4096,
            spec_mode="ar",
        )
    )
    timer = RoundTimer(engine.executor, 8)
    rows_out = []
    for mode, rows, per_seq in [("ar", r, 1) for r in AR_ROWS] + [
        ("spec", r, 8) for r in SPEC_ROWS
    ]:
        ms = timer.time_round(r := rows, args.kv_len, args.repeats, rows_per_seq=per_seq)
        num_seqs = r // per_seq
        kv_tokens = num_seqs * args.kv_len
        roof = roofline_ms(engine, r, kv_tokens, ceilings)
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
    # Where the device time of one 64-row AR round goes, kernel by kernel.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timer.time_round(64, args.kv_len, 3)
    kernel_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(kernel_table)
    idle = {
        "ar": gpu_idle_fraction(engine, args.idle_concurrency, 512, args.idle_rounds),
    }
    record = {
        "gpu": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "model": args.model,
        "kv_len": args.kv_len,
        "ceilings": ceilings,
        "rounds": rows_out,
        "idle": idle,
        "kernel_table_ar64": kernel_table,
        "graph_memory_bytes": engine.executor.graphs.memory_bytes if engine.executor.graphs else 0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "executor.json").write_text(json.dumps(record, indent=1))
    worst = max(r["ratio"] for r in rows_out)
    lines = [
        "# Round executor: round time against the roofline",
        "",
        f"Measured on {record['gpu']}, {record['date']}, torch {record['torch']}, by "
        "`python -m loadtests.executor_bench` (JSON: `executor.json`).",
        "",
        f"Ceilings measured in the same run: copy {ceilings['copy_read_plus_write_TBps']} TB/s "
        f"(read + write), bf16 GEMM {ceilings['bf16_gemm_TFLOPs']} TFLOP/s. Model "
        f"`{args.model}` (random bf16 weights), {args.kv_len} tokens of context per sequence.",
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
        f"Worst ratio: {worst:.2f} (target <= 1.3).",
        "",
        "GPU idle in the engine loop (decode rounds, greedy AR):",
        "",
        "| C | wall ms/round | GPU busy ms/round | idle |",
        "|---:|---:|---:|---:|",
    ]
    for v in idle.values():
        lines.append(
            f"| {v['concurrency']} | {v['wall_ms_per_round']:.3f} | "
            f"{v['gpu_busy_ms_per_round']:.3f} | {100 * v['gpu_idle_fraction']:.1f}% |"
        )
    lines += [
        "",
        "Device time of a 64-row AR round by kernel (torch profiler, 3 rounds + warm-up):",
        "",
        "```",
        kernel_table.rstrip(),
        "```",
    ]
    (out / "executor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
