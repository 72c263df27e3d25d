"""Whether the drafter follows a round's prefill chunks (`drafter_follows_prefill`).

auto: where the speculation the policy would choose on the live batch, every request decoding
with its drafter caught up, saves more than following the starting prompts costs
(`AdaptivePolicy.following_pays`; a fixed policy: whether it speculates). The question is one
search of the depth planner over every live request, so it is asked when a prompt starts and
its answer is kept: by chunks that continue prompts (a prompt is followed only as far as its
chunks continue the draft KV, so switching midway wastes what was followed), and by prompts
starting within FOLLOW_RECHECK_ROUNDS of it while the live batch keeps its size, within
1/FOLLOW_SIZE_TOLERANCE of it (exactly, below that many requests): a refilled batch moves by a
request or two between starts. The whole live batch is asked about, not the requests decoding
now: while slots fill, the few that decode are held to the rate of all live requests and never
speculate, yet the prompts starting then are the batch that decodes next.
"""

from __future__ import annotations

from scheduler.acceptance import AcceptanceEstimator
from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostModel
from scheduler.lifecycle import RequestLifecycle
from scheduler.policy_api import SpecPolicy
from scheduler.policy_view import PolicyViews
from scheduler.prefill_chunks import PrefillChunk

FOLLOW_RECHECK_ROUNDS = 32
FOLLOW_SIZE_TOLERANCE = 8


class FollowPrefillChoice:
    def __init__(
        self,
        config: SchedulerConfig,
        lifecycle: RequestLifecycle,
        views: PolicyViews,
        estimator: AcceptanceEstimator,
        cost_model: CostModel,
    ):
        self.config = config
        self.lifecycle = lifecycle
        self.views = views
        self.estimator = estimator
        self.cost_model = cost_model
        self._answer = False  # the last answer of auto
        self._asked_round = -FOLLOW_RECHECK_ROUNDS  # when it was asked
        self._asked_live = -1  # and of how many live requests

    def follows(
        self,
        chunks: list[PrefillChunk],
        policy: SpecPolicy,
        round_id: int,
        cohort_changed: bool,
    ) -> bool:
        mode = self.config.drafter_follows_prefill
        if mode == "off" or self.config.max_drafts == 0:
            return False
        if mode == "on":
            return True
        # a prompt starts with its first chunk, after a cached prefix if it found one
        if not any(c.req.num_computed == c.req.num_cached_tokens for c in chunks):
            return self._answer
        num_live = len(self.lifecycle.live)
        asked_live = self._asked_live
        same_size = abs(num_live - asked_live) <= asked_live // FOLLOW_SIZE_TOLERANCE
        if round_id - self._asked_round < FOLLOW_RECHECK_ROUNDS and same_size:
            return self._answer
        self._asked_round, self._asked_live = round_id, num_live
        if (ask := getattr(policy, "following_pays", None)) is None:
            follow = self.config.spec_mode == "spec"
        else:
            starting = [c.req for c in chunks if c.req.num_computed == c.req.num_cached_tokens]
            profile = self.cost_model.profile
            follow_ms = sum(profile.follow_ms(r.num_prefill_target) for r in starting)
            num_tokens = float(sum(r.num_remaining for r in starting))
            view = self.views.steady_view(round_id, cohort_changed)
            follow = bool(ask(view, self.estimator, self.cost_model, follow_ms, num_tokens))
        self._answer = follow
        return follow
