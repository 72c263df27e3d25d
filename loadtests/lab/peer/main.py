"""`hipfire-bench peer-vllm`: this engine against vLLM on one GPU, the same shape (random
weights of a real shape, default Qwen3-8B's, or a checkpoint), prompts (token ids) and settings,
each engine in its own child process, one after the other, in one call.

    hipfire-bench peer-vllm --out OUT                          # both engines, the full grid
    hipfire-bench peer-vllm --out OUT --vllm-pythonpath A:B    # vLLM from a staged bundle
    hipfire-bench peer-vllm --quick --out OUT                  # ours alone, random:tiny on CPU
    hipfire-bench peer-vllm --merge A/peer-vllm.json B/peer-vllm.json --out OUT
Staging vLLM on a machine without a package registry: loadtests/README.md ("Side by side
with vLLM")."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtests.lab.cli_args import int_tuple
from loadtests.lab.peer.children import ROOT, child_env, probe_vllm, read_result, run_child
from loadtests.lab.peer.config import ENGINES, QUICK, WORKLOADS, PeerConfig
from loadtests.lab.peer.report import build_record, merge_records, summary_table, write_outputs
from loadtests.lab.peer.roofline import wave_roofline
from loadtests.lab.peer.shape import (
    DTYPE_BYTES,
    NO_PEER_CONFIG,
    dtype_of,
    hf_config,
    num_params,
    resolve_shape,
    write_hf_config,
)

PROG = "hipfire-bench peer-vllm"
REPORT_RESERVE_S = 15.0  # of the time budget, kept for the report and the plot
CEILINGS_S = 120.0

METHOD = """\
One call, in order: `import vllm` tried in a child (with --vllm-pythonpath on its PYTHONPATH
and VLLM_USE_FLASHINFER_SAMPLER=0); the copy bandwidth and bf16 GEMM rate measured in a child
(executor/profiling/device.py); then each engine in its own child, its share of what is left
of --time-budget-s as its deadline: start-up, then the wave at every C, then the chat-like
workload at every C, each workload after an unmeasured warm-up (a point that would pass the
deadline is skipped and listed). Both engines: plain decoding, greedy, EOS ignored, no prefix
caching, the largest C as their request capacity, the same context length; otherwise each at
its defaults (vLLM's FlashAttention, torch.compile, CUDA graphs captured at start-up and
chunked prefill; this engine's graphs captured at first use, which the warm-ups and the best of
--repeats keep out of the wave's figures). The figures are defined in loadtests/lab/peer/
drive.py, the roofline in roofline.py. Writes peer-vllm.md, .json and .png (or --name's) to --out.
"""


def _names(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def _pair(text: str) -> tuple[int, int]:
    values = int_tuple(text)
    if len(values) != 2:
        raise ValueError(f"expected MIN,MAX, got {text!r}")
    return values  # type: ignore[return-value]


def _lognormal(text: str) -> tuple[int, float, int, int]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 4 or not parts[2] <= parts[0] <= parts[3] or parts[1] < 0:
        raise ValueError(f"expected MEDIAN,SIGMA,LO,HI with LO <= MEDIAN <= HI, got {text!r}")
    return int(parts[0]), parts[1], int(parts[2]), int(parts[3])


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(f"expected on or off, got {text!r}")
    return text == "on"


# flag -> (PeerConfig field, parser, help); every flag defaults to the preset's value
FLAGS = {
    "--model": ("model", str, "'random:NAME' (random weights of a real shape) or a directory"),
    "--engines": ("engines", _names, f"comma-separated, from {', '.join(ENGINES)}"),
    "--workloads": ("workloads", _names, f"comma-separated, from {', '.join(WORKLOADS)}"),
    "--concurrency": ("concurrency", int_tuple, "concurrency values C"),
    "--wave-prompt-len": ("wave_prompt_len", _pair, "wave prompt lengths MIN,MAX"),
    "--decode-tokens": ("decode_tokens", int, "wave decode tokens N after the first"),
    "--repeats": ("repeats", int, "wave timings per point (the best kept)"),
    "--chat-prompt-len": ("chat_prompt_len", _lognormal, "chat prompts MEDIAN,SIGMA,LO,HI"),
    "--chat-output-len": ("chat_output_len", _lognormal, "chat outputs MEDIAN,SIGMA,LO,HI"),
    "--chat-waves": ("chat_waves", int, "chat requests per C: max(waves x C, min)"),
    "--chat-min-requests": ("chat_min_requests", int, "chat requests per C at least"),
    "--mt-system-len": ("mt_system_len", int, "multiturn shared system prompt tokens"),
    "--mt-turns": ("mt_turns", int, "multiturn turns per conversation"),
    "--mt-user-len": ("mt_user_len", _lognormal, "multiturn user messages MEDIAN,SIGMA,LO,HI"),
    "--mt-output-len": ("mt_output_len", _lognormal, "multiturn replies MEDIAN,SIGMA,LO,HI"),
    "--mt-waves": ("mt_waves", int, "multiturn conversations per C: max(waves x C, min)"),
    "--mt-min-conversations": ("mt_min_conversations", int, "multiturn conversations at least"),
    "--prefix-caching": ("prefix_caching", _on_off, "both engines' prefix caching: on or off"),
    "--seed": ("seed", int, "seed of the prompts and lengths"),
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
        epilog=METHOD,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="folder for peer-vllm.md, .json and .png")
    ap.add_argument("--quick", action="store_true", help="small CPU preset: ours on random:tiny")
    ap.add_argument(
        "--vllm-pythonpath",
        default="",
        help="put in front of the vLLM child's PYTHONPATH (a staged bundle, e.g. two folders "
        "joined by ':'); also sets VLLM_USE_FLASHINFER_SAMPLER=0 there",
    )
    ap.add_argument("--commit", default="", help="the commit to record (default: git's HEAD)")
    ap.add_argument(
        "--name",
        default="peer-vllm",
        help="the record's file names: NAME.md, .json and .png (default peer-vllm)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: merge records of earlier calls (an engine in a later one "
        "replaces an earlier one's) and write the report",
    )
    for flag, (name, _, help_) in FLAGS.items():
        default = getattr(PeerConfig, name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        shown = ("on" if shown else "off") if isinstance(default, bool) else shown
        ap.add_argument(flag, default=None, help=f"{help_} (default {shown})")
    return ap


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    changes = {}
    for flag, (name, parse, _) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[name] = parse(value)
    cfg = dataclasses.replace(QUICK if args.quick else PeerConfig(), **changes)
    cfg.validate()
    return cfg


def git_commit() -> str:
    """HEAD's short hash, '+dirty' where tracked files differ from it; 'unknown' without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _log(t_start: float, msg: str) -> None:
    print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)


def _vllm_missing(cfg: PeerConfig, vllm_pythonpath: str) -> str | None:
    """Why vLLM cannot run here (None where `import vllm` works in a child)."""
    if "vllm" not in cfg.engines:
        return None
    version, why = probe_vllm(vllm_pythonpath)
    return None if version else why


def measure_ceilings(cfg: PeerConfig, tmp: Path) -> dict:
    """The ceilings child's result; no ceilings on a CPU run."""
    if cfg.device == "cpu":
        return {"ceilings": {}, "device_name": "cpu"}
    out = tmp / "ceilings.json"
    status = run_child(
        "loadtests.lab.peer.ceilings_child",
        [str(out)],
        child_env("ceilings"),
        time.time() + CEILINGS_S,
    )
    if status != 0 or not out.is_file():
        return {"ceilings": {}, "device_name": "unknown", "error": f"exit status {status}"}
    return json.loads(out.read_text())


def run_engine(engine: str, spec: dict, tmp: Path, vllm_pythonpath: str) -> dict:
    spec_path, out = tmp / f"spec-{engine}.json", tmp / f"result-{engine}.json"
    spec_path.write_text(json.dumps(spec))
    base = engine.split("-")[0]  # hipfire-nocache runs hipfire's child
    module = f"loadtests.lab.peer.{base}_child"
    env = child_env(base, vllm_pythonpath)
    status = run_child(module, [str(spec_path), str(out)], env, spec["deadline"])
    return read_result(out, engine, status)


def measure(cfg: PeerConfig, args: argparse.Namespace, t_start: float, save) -> dict | None:
    """Runs the children, handing the record to `save` after each engine (so a call stopped
    from outside keeps what finished); returns it, or None (after a one-line message) where
    nothing can run."""
    try:
        shape = resolve_shape(cfg.model)
        dtype = dtype_of(shape, cfg.dtype)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None
    engines = list(cfg.engines)
    missing = {}
    if "vllm" in engines and shape.arch in NO_PEER_CONFIG:
        engines.remove("vllm")
        missing["vllm"] = f"no vLLM config is written for {shape.arch}"
        print(f"{PROG}: vllm not run: {missing['vllm']}", file=sys.stderr, flush=True)
        if not engines:
            return None
    why = _vllm_missing(cfg, args.vllm_pythonpath) if "vllm" in engines else None
    if why is not None:
        engines.remove("vllm")
        alone = f"; measuring {', '.join(engines)} alone" if engines else ""
        print(
            f"{PROG}: vLLM is not importable in a child process ({why}); pip-install vllm or "
            f"pass --vllm-pythonpath{alone}",
            file=sys.stderr,
            flush=True,
        )
        if not engines:
            return None
        missing["vllm"] = why
    shape_info = {
        "model": cfg.model,
        "dtype": dtype,
        "num_params": num_params(shape),
        "kv_bytes_per_token": shape.kv_bytes_per_token(DTYPE_BYTES[dtype]),
        "hf_config": None if shape.arch in NO_PEER_CONFIG else hf_config(shape),
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
        roofline = wave_roofline(cfg, shape, dtype, device["ceilings"])
        return build_record(cfg, shape_info, device["ceilings"], roofline, results, missing, meta)

    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        device = measure_ceilings(cfg, tmp)
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
                "config": cfg.to_json(),
                "deadline": time.time() + share,
                "dtype": dtype,
                "model_path": model_path,
                "vocab_size": shape.vocab_size,
                "vllm_model": str(vllm_model.resolve()),
                "random_weights": random_weights,
                "prefix_caching": cfg.prefix_caching and engine != "hipfire-nocache",
            }
            _log(t_start, f"{engine}: starting, {share:.0f} s to its deadline")
            res = results[engine] = run_engine(engine, spec, tmp, args.vllm_pythonpath)
            counts = ", ".join(f"{len(res.get(w, []))} {w} points" for w in cfg.workloads)
            _log(t_start, f"{engine}: {res.get('error') or 'done'}; {counts}")
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
    failed = [name for name, res in record["engines"].items() if res.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
