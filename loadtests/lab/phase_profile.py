"""`hipfire-bench phase-profile`: where the device time of a plain decode step goes (GEMM,
attention, norms, RoPE, activation, sampling, copies, the host gap), for this engine and vLLM on
one GPU, the same shape (random weights of a real shape, default Qwen3-8B's) and prompts, each
engine in its own child process, one after the other, in one call.

    hipfire-bench phase-profile --out OUT                          # both engines, C = 64,128,256
    hipfire-bench phase-profile --out OUT --vllm-pythonpath A:B    # vLLM from a staged bundle
    hipfire-bench phase-profile --quick --out OUT                  # ours alone, random:tiny, CPU
    hipfire-bench phase-profile --merge A/decode-phases.json B/decode-phases.json --out OUT
The method is in loadtests/lab/phases/child.py, the phase rules in phases/classify.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lab.cli_args import int_tuple
from loadtests.lab.peer.children import child_env, probe_vllm, read_result, run_child
from loadtests.lab.peer.main import git_commit, measure_ceilings
from loadtests.lab.peer.shape import (
    DTYPE_BYTES,
    NO_PEER_CONFIG,
    dtype_of,
    num_params,
    resolve_shape,
    write_hf_config,
)
from loadtests.lab.phases.config import ENGINES, QUICK, PhaseConfig
from loadtests.lab.phases.report import (
    build_record,
    merge_records,
    roofline,
    summary_table,
    write_outputs,
)

PROG = "hipfire-bench phase-profile"
REPORT_RESERVE_S = 15.0  # of the time budget, kept for the report and the plot


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def _pair(text: str) -> tuple[int, int]:
    values = int_tuple(text)
    if len(values) != 2:
        raise ValueError(f"expected MIN,MAX, got {text!r}")
    return values  # type: ignore[return-value]


# flag -> (PhaseConfig field, parser, help); every flag defaults to the preset's value
FLAGS = {
    "--model": ("model", str, "'random:NAME' (random weights of a real shape) or a directory"),
    "--engines": ("engines", _names, f"comma-separated, from {', '.join(ENGINES)}"),
    "--concurrency": ("concurrency", int_tuple, "concurrency values C"),
    "--prompt-len": ("prompt_len", _pair, "prompt lengths MIN,MAX (uniform)"),
    "--warmup-steps": ("warmup_steps", int, "decode steps after the prefill, not timed"),
    "--steps": ("steps", int, "decode steps timed, then as many profiled"),
    "--seed": ("seed", int, "seed of the prompts"),
    "--device": ("device", str, "torch device of this engine ('auto', 'cuda', 'cpu')"),
    "--dtype": ("dtype", str, "weights dtype of both ('auto': the shape's)"),
    "--hipfire-graphs": ("hipfire_graphs", str, "this engine's decode graphs"),
    "--vllm-gpu-memory-utilization": (
        "vllm_gpu_memory_utilization",
        float,
        "vLLM's gpu_memory_utilization (0: its default)",
    ),
    "--time-budget-s": ("time_budget_s", float, "wall-clock bound of the whole call"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="folder for NAME.md, .json and .png")
    ap.add_argument("--quick", action="store_true", help="small CPU preset: ours on random:tiny")
    ap.add_argument(
        "--vllm-pythonpath",
        default="",
        help="put in front of the vLLM child's PYTHONPATH (a staged bundle, e.g. two folders "
        "joined by ':'); also sets VLLM_USE_FLASHINFER_SAMPLER=0 there",
    )
    ap.add_argument("--commit", default="", help="the commit to record (default: git's HEAD)")
    ap.add_argument("--name", default="decode-phases", help="the files' names (NAME.md, ...)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: merge records of earlier calls (an engine in a later one "
        "replaces an earlier one's), re-classify their kernels and write the report",
    )
    for flag, (name, _, help_) in FLAGS.items():
        default = getattr(PhaseConfig, name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        ap.add_argument(flag, default=None, help=f"{help_} (default {shown})")
    return ap


def config_from_args(args: argparse.Namespace) -> PhaseConfig:
    changes = {}
    for flag, (name, parse, _) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[name] = parse(value)
    cfg = dataclasses.replace(QUICK if args.quick else PhaseConfig(), **changes)
    cfg.validate()
    return cfg


def _log(t_start: float, msg: str) -> None:
    print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)


def _engines(cfg: PhaseConfig, arch: str, vllm_pythonpath: str) -> tuple[list[str], dict]:
    """The engines that can run here, and why each other one cannot."""
    engines, missing = list(cfg.engines), {}
    if "vllm" in engines and arch in NO_PEER_CONFIG:
        missing["vllm"] = f"no vLLM config is written for {arch}"
    elif "vllm" in engines:
        version, why = probe_vllm(vllm_pythonpath)
        if version is None:
            missing["vllm"] = why
    for engine, why in missing.items():
        engines.remove(engine)
        alone = f"; measuring {', '.join(engines)} alone" if engines else ""
        print(f"{PROG}: {engine} not run ({why}){alone}", file=sys.stderr, flush=True)
    return engines, missing


def measure(cfg: PhaseConfig, args: argparse.Namespace, t_start: float, save) -> dict | None:
    """Runs the children, handing the record to `save` after each engine; returns it, or None
    (after a one-line message) where nothing can run."""
    try:
        shape = resolve_shape(cfg.model)
        dtype = dtype_of(shape, cfg.dtype)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None
    engines, missing = _engines(cfg, shape.arch, args.vllm_pythonpath)
    if not engines:
        return None
    shape_info = {
        "model": cfg.model,
        "dtype": dtype,
        "num_params": num_params(shape),
        "kv_bytes_per_token": shape.kv_bytes_per_token(DTYPE_BYTES[dtype]),
    }
    commit = args.commit or git_commit()
    deadline_all = t_start + cfg.time_budget_s - REPORT_RESERVE_S
    results: dict[str, dict] = {}

    def record() -> dict:
        first = next(iter(results.values()), {})
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit,
            "elapsed_s": time.time() - t_start,
            "device": device["device_name"] if device["ceilings"] else first.get("device_name"),
            "torch": first.get("torch") or device.get("torch"),
        }
        roof = roofline(cfg, dtype, device["ceilings"])
        return build_record(cfg, shape_info, device["ceilings"], roof, results, missing, meta)

    with tempfile.TemporaryDirectory(prefix="phase-profile-") as tmp_name:
        tmp = Path(tmp_name)
        device = measure_ceilings(cfg.peer_config(), tmp)
        _log(t_start, f"device {device['device_name']}, ceilings {device['ceilings'] or 'none'}")
        random_weights = cfg.model.startswith("random:")
        # children run in the repository's root: a checkpoint goes to them as an absolute path
        model_path = cfg.model if random_weights else str(Path(cfg.model).resolve())
        if not random_weights:
            vllm_model = Path(model_path)
        elif "vllm" in engines:
            vllm_model = write_hf_config(shape, tmp / "hf")
        else:
            vllm_model = tmp / "hf"  # not read: vLLM does not run
        for i, engine in enumerate(engines):
            share = (deadline_all - time.time()) / (len(engines) - i)
            spec = {
                "phase_config": cfg.to_json(),
                "deadline": time.time() + share,
                "dtype": dtype,
                "model_path": model_path,
                "vocab_size": shape.vocab_size,
                "vllm_model": str(vllm_model.resolve()),
                "random_weights": random_weights,
                "prefix_caching": False,
            }
            _log(t_start, f"{engine}: starting, {share:.0f} s to its deadline")
            spec_path, out = tmp / f"spec-{engine}.json", tmp / f"result-{engine}.json"
            spec_path.write_text(json.dumps(spec))
            env = child_env(engine, args.vllm_pythonpath)
            if engine == "vllm":
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            child_args = [engine, str(spec_path), str(out)]
            status = run_child("loadtests.lab.phases.child", child_args, env, spec["deadline"])
            res = results[engine] = read_result(out, engine, status)
            _log(
                t_start,
                f"{engine}: {res.get('error') or 'done'}; {len(res.get('points', []))} points",
            )
            if i < len(engines) - 1:
                save(record())
    return record()


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.merge:
        try:
            record = merge_records([json.loads(Path(p).read_text()) for p in args.merge])
        except (OSError, ValueError, KeyError) as e:
            print(f"{PROG}: cannot merge: {e}", file=sys.stderr)
            return 2
    else:
        try:
            cfg = config_from_args(args)
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 2
        record = measure(cfg, args, t_start, lambda rec: write_outputs(rec, out, args.name))
        if record is None:
            return 2
    print(summary_table(record))
    paths = write_outputs(record, out, args.name)
    _log(t_start, f"wrote {', '.join(p.name for p in paths)} to {out}")
    failed = [e for e, res in record["engines"].items() if res.get("error") or res.get("errors")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
