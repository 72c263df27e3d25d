"""The engine's cost profile: what the scheduler's cost model starts from.

`resolve_cost_model(engine)` is the one path to it (a profile file, the cached profile of the
set-up, or one measured now and cached); `Engine.install_cost_model` puts it to use.
`build.build_profile` measures a profile on an engine, `engine_steps` times whole engine steps
for it, `cache` keys and stores profiles, `cli` is `hipfire-serve profile`.
"""

from __future__ import annotations

from hipfire_serve.cost_profile.resolve import resolve_cost_model

__all__ = ["resolve_cost_model"]
