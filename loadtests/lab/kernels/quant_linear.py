"""Benchmark of the weight-only quantized skinny kernels (FP8 W8A16 `kernels/fp8_linear.py`,
int4 W4A16 `kernels/int4_linear.py`) at Qwen3-8B's decode-size projections on one GPU, against
bf16 cuBLAS on the same shapes; a tile sweep that names the best family entry; writes
quant-linear.json and quant-linear.md and prints the table.

    hipfire-bench quant-linear --out DIR [--rows 1,4,16] [--shapes qkv,down] [--formats fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from loadtests.lab.kernels.linear import SHAPES, copy_bandwidth_tbps, time_calls

METHOD = """\
Per projection of one Qwen3-8B layer (qkv, o_proj, gate_up, down) and row count it times bf16
`F.linear` (cuBLAS) and, for each format, every candidate tile (block_n x block_k, warps,
stages; dot tiles with the rows padded to 16, and for 1-2 rows fp32 multiply-add tiles) at the
split-K the kernel's rule picks (`fill_split`) and at half and twice that. Each timing is the
median over graph replays of back-to-back calls rotating over enough weight copies that no call
finds its weight in L2. Weight bandwidth: the bytes the format reads (FP8: N x K plus the
scales; int4: N x K / 2 plus group scales and zeros) over the time, against the copy bandwidth
measured in the same run. Every candidate is checked against the format's torch reference.
FP8 also times its W8A8 path (`executor/quant/fp8.py: scaled_mm_linear`: each row scaled to
FP8 by its absmax, then row-wise `torch._scaled_mm`), as it runs past 16 rows.
The record's `best_tile` per format is the tile whose summed time over all points, each at the
rule's split, is least: the entry for the family's table.
"""

FORMATS = ("fp8", "int4")
ROWS = (1, 4, 16)
GROUP = 128  # int4 inputs per scale (the GPTQ releases')
# (block_n, block_k, num_warps, num_stages): dot tiles, and multiply-add tiles for 1-2 rows
DOT_TILES = {
    "fp8": [(bn, bk, w, s) for bn in (32, 64, 128) for bk in (128, 256, 512)
            for (w, s) in ((4, 3), (8, 4))],
    "int4": [(bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128)
             for (w, s) in ((4, 3), (8, 4), (4, 2))],
}  # fmt: skip
FMA_TILES = {"fp8": [(32, 128, 4, 2), (64, 256, 4, 2)], "int4": [(32, 64, 4, 1), (64, 128, 4, 1)]}
INT4_MAX_ROWS = 16  # kernels/int4_linear.py's skinny kernel; more rows run its tiled one
ROTATE_BYTES = 256 << 20
REPLAY_US = 3000.0
MAX_REL_ERR = 2e-2


def _fp8_case(n: int, k: int, copies: int, gen):
    from executor.quant.fp8 import FP8, FP8_MAX

    out = []
    for _ in range(copies):
        w = torch.randn((n, k), generator=gen, device=gen.device) * 0.02
        scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)  # [N]
        out.append(((w / scale[:, None]).to(FP8), scale.float().contiguous()))
    return out, n * k + 4 * n


def _int4_case(n: int, k: int, copies: int, gen):
    from executor.quant.int4 import pack_rows

    out = []
    for _ in range(copies):
        q = torch.randint(0, 16, (k, n), generator=gen, device=gen.device)
        scales = torch.rand((k // GROUP, n), generator=gen, device=gen.device) * 0.02 + 0.005
        zeros = torch.full((k // GROUP, n), 8, dtype=torch.uint8, device=gen.device)
        out.append((pack_rows(q), scales.to(torch.bfloat16), zeros))
    return out, n * k // 2 + (k // GROUP) * n * 3


def _runner(fmt: str):
    """(call(x, weight, cfg), reference(x, weight), the kernel's config class)."""
    from kernels import fp8_linear as f8
    from kernels import int4_linear as i4

    if fmt == "fp8":
        decode_bits = f8.FP8_TILES["hopper"].decode_bits

        def call(x, w, cfg):
            return f8.fp8_skinny(x, w[0], w[1], None, cfg, decode_bits)

        def ref(x, w):
            return f8.fp8_linear_ref(x, w[0], w[1])

        return call, ref, f8.Fp8SkinnyConfig

    def call(x, w, cfg):
        return i4.int4_skinny(x, w[0], w[1], w[2], None, GROUP, None, cfg)

    def ref(x, w):
        return i4.int4_linear_ref(x, w[0], w[1], w[2], None, GROUP)

    return call, ref, i4.Int4SkinnyConfig


def candidates(fmt: str, n: int, k: int, rows: int, num_sms: int) -> list[tuple[tuple, int, bool]]:
    """(tile, split, is the rule's split) of one point."""
    from kernels.int4_linear import fill_split

    tiles = [(t, True) for t in DOT_TILES[fmt]]
    if rows <= 2:
        tiles += [(t, False) for t in FMA_TILES[fmt]]
    out = []
    for tile, dot in tiles:
        bn, bk = tile[0], tile[1]
        rule = fill_split(n, k, bn, bk, num_sms)
        for split in sorted({max(1, rule // 2), rule, rule * 2}):
            if k // split >= bk:
                out.append(((*tile, dot), split, split == rule))
    return out


def bench_point(fmt, name, n, k, rows, weights, wbytes, copy_bw, num_sms, gen) -> dict:
    call, ref_fn, config_cls = _runner(fmt)
    x = torch.randn((rows, k), generator=gen, device=gen.device).to(torch.bfloat16)
    ref = ref_fn(x, weights[0]).float()
    est_us = wbytes / (copy_bw * 0.9e12) * 1e6
    calls = int(min(64, max(4, round(REPLAY_US / est_us))))
    results = []
    for (bn, bk, warps, stages, dot), split, is_rule in candidates(fmt, n, k, rows, num_sms):
        cfg = config_cls(bn, bk, split, warps, stages, dot)
        label = f"{bn}x{bk} w{warps} s{stages} {'dot' if dot else 'fma'} split {split}"
        try:
            err = (call(x, weights[0], cfg).float() - ref).abs().max().item()
            err /= ref.abs().max().item()
            us = time_calls(lambda i, c=cfg: call(x, weights[i], c), len(weights), calls)
        except Exception as exc:  # a tile the compiler refuses: recorded, not fatal
            results.append({"variant": label, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        results.append(
            {
                "variant": label,
                "tile": [bn, bk, warps, stages, dot],
                "split": split,
                "rule_split": is_rule,
                "us": round(us, 2),
                "rel_err": err,
                "ok": err < MAX_REL_ERR,
            }
        )
    ok = [r for r in results if r.get("ok")]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    w8a8 = None
    if fmt == "fp8":  # the W8A8 path: activations scaled to FP8 per token, then _scaled_mm
        from executor.quant.fp8 import scaled_mm_linear

        try:
            w8a8 = round(time_calls(lambda i: scaled_mm_linear(x, *weights[i]),
                                    len(weights), calls), 2)  # fmt: skip
        except Exception as exc:  # a torch without row-wise _scaled_mm on this GPU
            w8a8 = f"{type(exc).__name__}: {exc}"[:200]
    return {
        "format": fmt,
        "shape": name,
        "n": n,
        "k": k,
        "rows": rows,
        "weight_bytes": wbytes,
        "best": best,
        "best_tbps": round(wbytes / (best["us"] * 1e-6) / 1e12, 3) if best else None,
        "w8a8_scaled_mm_us": w8a8,
        "variants": results,
    }


def bf16_point(name, n, k, rows, copy_bw, gen) -> dict:
    wbytes = n * k * 2
    copies = max(1, math.ceil(ROTATE_BYTES / wbytes))
    weights = [(torch.randn((n, k), generator=gen, device=gen.device) * 0.02).to(torch.bfloat16)
               for _ in range(copies)]  # fmt: skip
    x = torch.randn((rows, k), generator=gen, device=gen.device).to(torch.bfloat16)
    calls = int(min(64, max(4, round(REPLAY_US / (wbytes / (copy_bw * 0.9e12) * 1e6)))))
    us = time_calls(lambda i: F.linear(x, weights[i]), copies, calls)
    return {"shape": name, "rows": rows, "us": round(us, 2),
            "tbps": round(wbytes / (us * 1e-6) / 1e12, 3)}  # fmt: skip


def best_tiles(points: list[dict]) -> dict:
    """Per format: the tile whose time summed over every point (each at the rule's split) is
    least, with that sum and the sum of the per-point bests."""
    out = {}
    for fmt in {p["format"] for p in points}:
        mine = [p for p in points if p["format"] == fmt]
        sums: dict[tuple, float] = defaultdict(float)
        counts: dict[tuple, int] = defaultdict(int)
        for p in mine:
            for v in p["variants"]:
                if v.get("ok") and v["rule_split"]:
                    sums[tuple(v["tile"])] += v["us"]
                    counts[tuple(v["tile"])] += 1
        full = {t: s for t, s in sums.items() if counts[t] == len(mine)}
        if not full:
            continue
        tile = min(full, key=full.get)
        out[fmt] = {
            "tile": list(tile),
            "sum_us": round(full[tile], 2),
            "sum_best_us": round(sum(p["best"]["us"] for p in mine if p["best"]), 2),
        }
    return out


def markdown(record: dict) -> str:
    copy_bw = record["copy_bw_tbps"]
    bf16 = {(b["shape"], b["rows"]): b for b in record["bf16"]}
    lines = [
        f"# Quantized skinny linear kernels, {record['device']}, {record['date']}",
        "",
        f"By `hipfire-bench quant-linear` (JSON: `quant-linear.json`) at commit "
        f"`{record.get('commit', '-')}`, torch {record['torch']}, "
        f"Triton {record['triton']}, copy bandwidth {copy_bw} TB/s measured in the same run; "
        f"{record['wall_s']:.0f} s. Times are microseconds per call.",
        "",
        "| format | shape | rows | bf16 cuBLAS us | best tile | us | vs bf16 | TB/s | of copy "
        "| W8A8 _scaled_mm us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in record["points"]:
        b, best = bf16.get((p["shape"], p["rows"])), p["best"]
        if not best:
            lines.append(f"| {p['format']} | {p['shape']} | {p['rows']} | - | none ran |||||")
            continue
        ratio = f"{b['us'] / best['us']:.2f}x" if b else "-"
        lines.append(
            f"| {p['format']} | {p['shape']} | {p['rows']} | {b['us'] if b else '-'} | "
            f"{best['variant']} | {best['us']} | {ratio} | {p['best_tbps']} | "
            f"{p['best_tbps'] / copy_bw:.2f} | {p.get('w8a8_scaled_mm_us') or '-'} |"
        )
    lines += ["", "Best single tile per format (each point at the rule's split):", ""]
    for fmt, t in record["best_tiles"].items():
        lines.append(
            f"- {fmt}: block_n, block_k, warps, stages, dot = {t['tile']}: {t['sum_us']} us over "
            f"all points (per-point bests: {t['sum_best_us']} us)"
        )
    lines += ["", "## Method", "", METHOD]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(
        prog="hipfire-bench quant-linear",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        parser.error(f"--rows: comma-separated integers (got {args.rows!r})")
    if not rows or min(rows) < 1 or max(rows) > 64:
        parser.error("--rows: 1..64 (the skinny kernels' rows: FP8's up to 64, int4's 16)")
    shapes = args.shapes.split(",")
    formats = args.formats.split(",")
    if bad := [s for s in shapes if s not in SHAPES or s == "lm_head"]:
        parser.error(f"--shapes: unknown {', '.join(bad)} (qkv, o_proj, gate_up, down)")
    if bad := [f for f in formats if f not in FORMATS]:
        parser.error(f"--formats: unknown {', '.join(bad)} (fp8, int4)")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA/HIP GPU")
    t0 = time.time()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    copy_bw = copy_bandwidth_tbps()
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16, points = [], []
    for name in shapes:
        n, k = SHAPES[name]
        for r in rows:
            bf16.append(bf16_point(name, n, k, r, copy_bw, gen))
        for fmt in formats:
            one = (n * k) if fmt == "fp8" else (n * k // 2)
            copies = max(1, math.ceil(ROTATE_BYTES / one))
            make = _fp8_case if fmt == "fp8" else _int4_case
            weights, wbytes = make(n, k, copies, gen)
            for r in rows:
                if fmt == "int4" and r > INT4_MAX_ROWS:
                    continue
                p = bench_point(fmt, name, n, k, r, weights, wbytes, copy_bw,
                                props.multi_processor_count, gen)  # fmt: skip
                points.append(p)
                b = next(x for x in bf16 if x["shape"] == name and x["rows"] == r)
                best = p["best"] or {}
                print(f"{fmt:5s} {name:8s} rows {r:2d}: bf16 {b['us']:8.2f} us, best "
                      f"{best.get('us', float('nan')):8.2f} us ({best.get('variant')})",
                      flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    from loadtests.lab.peer.main import git_commit

    record = {
        "benchmark": "quant-linear",
        "device": props.name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bw_tbps": round(copy_bw, 3),
        "num_sms": props.multi_processor_count,
        "wall_s": round(time.time() - t0, 1),
        "bf16": bf16,
        "points": points,
        "best_tiles": best_tiles(points),
        "method": METHOD,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant-linear.json").write_text(json.dumps(record, indent=1))
    text = markdown(record)
    (args.out / "quant-linear.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
