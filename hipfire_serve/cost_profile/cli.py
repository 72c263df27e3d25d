"""`hipfire-serve profile`: measure the round-time cost profile of the loaded models on a device.

Writes the profile (`build.build_profile`) to `--out`, or to the profile cache under the key of
the set-up, where an engine started with `--cost-profile auto` finds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hipfire_serve.config import EngineConfig
from hipfire_serve.cost_profile.build import DEFAULT_KV_LENS, DEFAULT_ROWS, build_profile
from hipfire_serve.cost_profile.cache import cached_profile_path, engine_profile_key, save_profile
from hipfire_serve.engine import Engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hipfire-serve profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--spec-depth", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)))
    ap.add_argument("--kv-lens", default=",".join(map(str, DEFAULT_KV_LENS)))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--graphs", default="lazy", choices=("lazy", "off"))
    ap.add_argument("--out", default="", help="output JSON (default: the profile cache)")
    args = ap.parse_args(argv)
    try:
        engine = Engine(
            EngineConfig(
                model=args.model,
                draft=args.draft,
                device=args.device,
                dtype=args.dtype,
                max_concurrency=args.max_concurrency,
                spec_depth=args.spec_depth,
                kv_cache_memory=args.kv_cache_memory,
                kv_cache_dtype=args.kv_cache_dtype,
                graphs=args.graphs,
                spec_mode="ar",
            )
        )
        rows = tuple(int(x) for x in args.rows.split(","))
        kv_lens = tuple(int(x) for x in args.kv_lens.split(","))
    except (ValueError, OSError) as e:
        print(f"hipfire-serve profile: {e}", file=sys.stderr)
        return 2
    profile = build_profile(engine, rows, kv_lens, args.repeats)
    key = engine_profile_key(engine)
    out = Path(args.out) if args.out else cached_profile_path(key)
    save_profile(profile, key, out)
    print(f"{'rows':>6} {'ms':>9}")
    for n, ms in profile["target"]["rows_ms"]:
        print(f"{n:>6} {ms:>9.3f}")
    print(f"KV read rate {profile['target']['kv_read_TBps_assumed']} TB/s; wrote {out}")
    return 0
