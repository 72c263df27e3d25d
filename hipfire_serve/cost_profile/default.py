"""The cost model an engine runs with before any profile of its set-up exists (a CPU's first
start): flat prices that online calibration scales to the rounds it measures, with the shape
of the engine's drafter. A chain draft model pays a step per draft and catches up what it
missed; a block drafter pays one forward per round whatever the depth and never lags (every
target forward writes its context). Pricing a block drafter as a chain makes every draft and
every AR round's lag look expensive, so the adaptive policy would never speculate with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.cost_model import CostModel
from scheduler.profile_cost import ProfileCost
from scheduler.scheduler import default_profile

if TYPE_CHECKING:
    from hipfire_serve.engine import Engine


def default_cost_model(engine: Engine) -> CostModel:
    """The flat model for `engine`'s drafter (calibrated online from the first rounds)."""
    from executor.drafters.block_model import BlockDraftModel

    profile = default_profile()
    draft_model = getattr(getattr(engine.drafter, "inner", engine.drafter), "model", None)
    if isinstance(draft_model, BlockDraftModel):
        slots = max(2, engine.executor.max_slots)
        step = profile["draft_model"]["rows_ms_per_step"]  # [[1, ms], [rows, ms]]
        one, many = step[0][1], step[-1][1]
        drafts = sorted({1, max(1, engine.config.spec_depth - 1)})
        profile["draft_model"] = {
            "kind": "block",
            "rows_ms_per_step": [[1, 0.0], [slots, 0.0]],  # no chain steps
            # one proposal forward of k blocks, the same at every depth
            "propose_ms": [[k, d, ms] for k, ms in ((1, one), (slots, many)) for d in drafts],
            # a catch-up pass longer than any context: lag costs nothing
            "catchup_rows_per_pass": engine.max_model_len + engine.config.block_size,
            "max_catchup_passes": 1,
        }
    return CostModel(ProfileCost(profile))
