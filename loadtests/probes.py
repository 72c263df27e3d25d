"""What the GPU probes share: their common arguments, the engine they build, the device and date
they were measured on, and the one JSON file each writes."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def probe_parser(module: str, doc: str, filename: str) -> argparse.ArgumentParser:
    """A probe's parser with the arguments every probe takes: --out (the folder for
    `filename`), the target and draft models, device and dtype."""
    ap = argparse.ArgumentParser(
        prog=f"python3 -m loadtests.{module}", description=doc.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("--out", required=True, help=f"folder for {filename}")
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--draft", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    return ap


def probe_engine(args, max_concurrency: int, spec_depth: int, max_model_len: int, **config):
    """An engine on the probe's models, device, dtype and `--kv-cache-memory`, graphs captured
    lazily, deciding nothing by itself (spec_mode ar: the probes plan their own rounds);
    `config`: further EngineConfig fields."""
    from hipfire_serve.config import EngineConfig
    from hipfire_serve.engine import Engine

    return Engine(
        EngineConfig(
            model=args.model,
            draft=args.draft,
            device=args.device,
            dtype=args.dtype,
            max_concurrency=max_concurrency,
            spec_depth=spec_depth,
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=max_model_len,
            graphs="lazy",
            spec_mode="ar",
            **config,
        )
    )


def device_name(device) -> str:
    """The GPU's name ("cpu" off a GPU)."""
    if device.type != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def write_report(out: str | Path, filename: str, device, fields: dict, t0: float) -> dict:
    """{device, date, *fields, elapsed_s since the perf_counter `t0`} written as
    `out/filename` (the folder made if needed). -> the report"""
    report = {
        "device": device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **fields,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / filename).write_text(json.dumps(report, indent=1))
    return report
