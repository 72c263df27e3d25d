"""The engine's cost model from its `cost_profile` setting: load a profile, or measure and cache
one."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hipfire_serve.cost_profile.build import build_profile
from hipfire_serve.cost_profile.cache import cached_profile_path, engine_profile_key, save_profile
from hipfire_serve.cost_profile.default import default_cost_model
from scheduler.cost_model import CostModel

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine

log = logging.getLogger("hipfire_serve.cost_profile")

# The start-up profile: coarser than `hipfire-serve profile` (a few seconds on a GPU).
QUICK_PROFILE_ROWS = (1, 4, 16, 32, 64, 128, 256, 512)
QUICK_PROFILE_KV_LENS = (16, 1024)


def resolve_cost_model(engine: Engine) -> CostModel | None:
    """The cost model `engine.config.cost_profile` names. A path: that profile. 'auto': the
    cached profile of these models on this device (`hipfire-serve profile` writes it); without
    one, on a GPU a quick profile is measured now on the (idle) engine and cached, on a CPU
    the flat default shaped for the engine's drafter (`default.py`), which online calibration
    corrects. 'build': measure and
    cache now, on any device."""
    path = engine.config.cost_profile
    if path in ("auto", "build"):
        key = engine_profile_key(engine)
        cached = cached_profile_path(key)
        build = path == "build" or (not cached.is_file() and engine.device.type == "cuda")
        if build:
            log.info("measuring the cost profile of this set-up (cached for next time)")
            # (rows beyond slots x depth and contexts beyond the model are skipped there)
            profile = build_profile(
                engine, QUICK_PROFILE_ROWS, QUICK_PROFILE_KV_LENS, repeats=5, with_ceilings=False
            )
            save_profile(profile, key, cached)
        elif not cached.is_file():
            log.info("no cost profile cached for this set-up (run `hipfire-serve profile`)")
            return default_cost_model(engine)
        path = str(cached)
    try:
        return CostModel.from_file(path)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read cost profile {path}: {e}") from None
