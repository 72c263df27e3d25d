"""`hipfire-bench quant`: plain decoding of one shape (default Qwen3-8B's, random weights) in bf16,
FP8 (W8A8, 128 x 128 block scales as the Qwen3 FP8 release stores them) and W4A16 (GPTQ, group
128, symmetric), each format in its own child process in one call, each against its own
roofline (its weight bytes plus the KV at the copy bandwidth measured in the same call).

    hipfire-bench quant --out OUT                      # the three formats at C = 1 .. 128
    hipfire-bench quant --quick --out OUT              # random:tiny on the CPU, small C
Writes quant.md, quant.json and quant.png (or --name's) to OUT."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lab.cli_args import int_tuple
from loadtests.lab.peer.children import child_env, read_result, run_child
from loadtests.lab.peer.shape import resolve_shape
from loadtests.lab.quant_record import (
    METHOD,
    QUICK,
    REPORT_RESERVE_S,
    QuantConfig,
    build_record,
)
from loadtests.lab.quant_report import summary_table, write_outputs

PROG = "hipfire-bench quant"

# flag -> (QuantConfig field, parser, help); every flag defaults to the preset's value
FLAGS = {
    "--model": ("model", str, "'random:NAME': the shape whose random weights every format holds"),
    "--formats": ("formats", lambda t: tuple(v for v in t.split(",") if v), "of bf16,fp8,w4a16"),
    "--concurrency": ("concurrency", int_tuple, "concurrency values C"),
    "--wave-prompt-len": ("wave_prompt_len", int_tuple, "wave prompt lengths MIN,MAX"),
    "--decode-tokens": ("decode_tokens", int, "wave decode tokens N after the first"),
    "--repeats": ("repeats", int, "wave timings per point (the best kept)"),
    "--group-size": ("group_size", int, "w4a16 group size"),
    "--fp8-block": ("fp8_block", int_tuple, "fp8 weight block BN,BK"),
    "--agreement-prompts": ("agreement_prompts", int, "greedy agreement prompts"),
    "--agreement-tokens": ("agreement_tokens", int, "greedy agreement tokens per prompt"),
    "--seed": ("seed", int, "seed of the prompts and lengths"),
    "--device": ("device", str, "torch device ('auto', 'cuda', 'cpu')"),
    "--dtype": ("dtype", str, "the dense format's dtype"),
    "--graphs": ("graphs", str, "decode graphs: lazy, startup or off"),
    "--spec-mode": ("spec_mode", str, "ar (plain decoding) or adaptive (the engine's policy)"),
    "--draft": ("draft", str, "the drafter of --spec-mode adaptive"),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "auto (the activations' dtype) or fp8"),
    "--time-budget-s": ("time_budget_s", float, "wall-clock bound of the whole call"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="folder for quant.md, .json and .png")
    ap.add_argument("--quick", action="store_true", help="small CPU preset: random:tiny")
    ap.add_argument("--commit", default="", help="the commit to record (default: git's HEAD)")
    ap.add_argument("--name", default="quant", help="the record's file names (default quant)")
    for flag, (name, _, help_) in FLAGS.items():
        default = getattr(QuantConfig, name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        ap.add_argument(flag, default=None, help=f"{help_} (default {shown})")
    return ap


def config_from_args(args: argparse.Namespace) -> QuantConfig:
    changes = {}
    for flag, (name, parse, _) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[name] = parse(value)
    cfg = dataclasses.replace(QUICK if args.quick else QuantConfig(), **changes)
    cfg.validate()
    return cfg


def _log(t_start: float, msg: str) -> None:
    print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)


def run_format(fmt: str, cfg: QuantConfig, deadline: float, tmp: Path) -> dict:
    spec = {
        "format": fmt,
        "config": cfg.peer().to_json(),
        "deadline": deadline,
        "dtype": cfg.dtype,
        "model_path": cfg.model,
        "spec_mode": cfg.spec_mode,
        "draft": "none" if cfg.spec_mode == "ar" else cfg.draft,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "group_size": cfg.group_size,
        "fp8_block": list(cfg.fp8_block),
        "agreement": {"prompts": cfg.agreement_prompts, "tokens": cfg.agreement_tokens},
    }
    spec_path, out = tmp / f"spec-{fmt}.json", tmp / f"result-{fmt}.json"
    spec_path.write_text(json.dumps(spec))
    status = run_child("loadtests.lab.quant_child", [str(spec_path), str(out)],
                       child_env("hipfire"), deadline)  # fmt: skip
    return read_result(out, fmt, status)


def measure(cfg: QuantConfig, commit: str, t_start: float, save) -> dict:
    """Runs the ceilings child, then one child per format, handing the record to `save` after
    each (a call stopped from outside keeps what finished); returns the record."""
    from loadtests.lab.peer.main import measure_ceilings

    shape = resolve_shape(cfg.model)
    deadline_all = t_start + cfg.time_budget_s - REPORT_RESERVE_S
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="quant-") as tmp_name:
        tmp = Path(tmp_name)
        device = measure_ceilings(cfg.peer(), tmp)
        _log(t_start, f"device {device['device_name']}, ceilings {device['ceilings'] or 'none'}")

        def record() -> dict:
            first = next(iter(results.values()), {})
            meta = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "commit": commit,
                "elapsed_s": time.time() - t_start,
                "device": device["device_name"] if device["ceilings"] else first.get("device_name"),
                "torch": first.get("torch") or device.get("torch"),
            }
            return build_record(cfg, shape, device["ceilings"], results, meta)

        for i, fmt in enumerate(cfg.formats):
            share = (deadline_all - time.time()) / (len(cfg.formats) - i)
            _log(t_start, f"{fmt}: starting, {share:.0f} s to its deadline")
            res = results[fmt] = run_format(fmt, cfg, time.time() + share, tmp)
            _log(t_start, f"{fmt}: {res.get('error') or 'done'}; {len(res.get('wave', []))} points")
            save(record())
    return record()


def main(argv: list[str] | None = None) -> int:
    from loadtests.lab.peer.main import git_commit

    t_start = time.time()
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    record = measure(cfg, args.commit or git_commit(), t_start,
                     lambda rec: write_outputs(rec, out, args.name))  # fmt: skip
    print(summary_table(record))
    paths = write_outputs(record, out, args.name)
    _log(t_start, f"wrote {', '.join(p.name for p in paths)} to {out}")
    failed = [n for n, res in record["formats"].items() if res.get("error") or res.get("errors")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
