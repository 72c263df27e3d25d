"""Where profiles are cached: under the user's cache directory, by a key of the models, device,
dtype, KV cache dtype and executor configuration (and the profile's format)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine

CACHE_DIR = Path.home() / ".cache" / "hipfire-serve" / "profiles"
# Part of the cache key: raised when the profile gains a measurement the cost model prices by,
# so that a profile cached before it is measured anew.
PROFILE_FORMAT = 7


def profile_key(
    target_dir: str,
    draft: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    max_slots: int,
    kv_cache_dtype: str = "auto",
) -> str:
    h = hashlib.sha256()
    for path in (target_dir, draft):
        p = Path(path)
        cfg = p / "config.json"
        h.update(cfg.read_bytes() if cfg.is_file() else path.encode())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    h.update(f"{name}|{dtype}|{block_size}|{max_slots}|{torch.__version__}".encode())
    h.update(f"|format {PROFILE_FORMAT}".encode())
    if kv_cache_dtype != "auto":  # an FP8 cache halves the KV a round reads; keys of auto stay
        h.update(f"|kv {kv_cache_dtype}".encode())
    return h.hexdigest()[:16]


def engine_profile_key(engine: Engine) -> str:
    """The profile key of an engine's models, device and configuration."""
    return profile_key(
        str(engine.target_dir),
        engine.draft_spec,
        engine.device,
        engine.target.dtype,
        engine.config.block_size,
        engine.config.max_concurrency,
        # fp8 and fp8_e4m3 are one storage
        "auto" if engine.config.kv_cache_dtype == "auto" else "fp8_e4m3",
    )


def cached_profile_path(key: str) -> Path:
    return CACHE_DIR / f"{key}.json"


def save_profile(profile: dict, key: str, path: Path) -> None:
    """Writes `profile` with its key to `path` (directories made as needed)."""
    profile["key"] = key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1))
