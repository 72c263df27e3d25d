"""The round's speculation decision: how many drafts each decoding request gets.

Made by the policy on the round's view, or taken from a decision made ahead (`prepare`, while
the device runs the current round) when the round decodes exactly the requests it was made for
with no prefill chunk and no arrival or departure in between. A round planned while an advanced
round runs is AR for everyone: a speculative row needs its request's last token, still on the
device, for drafting.
"""

from __future__ import annotations

import msgspec
import numpy as np

from scheduler.acceptance import AcceptanceEstimator
from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostModel
from scheduler.pending_outcomes import PendingOutcomes
from scheduler.policy_api import SpecPolicy
from scheduler.policy_view import PolicyViews
from scheduler.prefill_chunks import PrefillChunk
from scheduler.slot_table import SlotTable


class RoundDecision(msgspec.Struct, frozen=True):
    num_draft: np.ndarray  # [n] drafts per decoding request; 0: AR
    reason: str
    probe: bool  # the policy's probe of the drafter (its outcomes weigh more in calibration)
    expected_accepted: float  # accepted drafts the estimators expect of these depths
    # tokens per ms of the round's all-AR alternative, the rate tracker's basis (0: none)
    ar_rate: float


class PreparedDecision(msgspec.Struct, frozen=True):
    """A decision made ahead for the next round's decoding requests."""

    slots: np.ndarray  # [n] the decoding-slot array it was made for (never changed in place)
    req_ids: np.ndarray  # [n]
    num_draft: np.ndarray  # [n]
    reason: str
    expected_accepted: float
    # every depth within the caps that cannot change before the plan (drafts allowed,
    # max_drafts): the plan then only checks the tokens each request has left
    within_caps: bool
    probe: bool


class RoundDecider:
    def __init__(
        self,
        config: SchedulerConfig,
        slot_table: SlotTable,
        views: PolicyViews,
        estimator: AcceptanceEstimator,
        cost_model: CostModel,
        outcomes: PendingOutcomes,
    ):
        self.config = config
        self.slot_table = slot_table
        self.views = views
        self.estimator = estimator
        self.cost_model = cost_model
        self.outcomes = outcomes
        self.prepared: PreparedDecision | None = None  # for the next round (prepare)

    def decide(
        self,
        policy: SpecPolicy,
        slots: np.ndarray,
        chunks: list[PrefillChunk],
        round_id: int,
        cohort_changed: bool,
    ) -> RoundDecision:
        n = len(slots)
        prepared, self.prepared = self.prepared, None
        if n == 0 or self.config.max_drafts == 0:
            reason = "no decoding request" if n == 0 else "no speculation"
            return RoundDecision(np.zeros(n, dtype=np.int64), reason, False, 0.0, 0.0)
        st = self.slot_table
        if (
            prepared is not None
            and not chunks
            and not cohort_changed
            and _made_for(prepared, slots, st)
        ):
            # Decided ahead for exactly these requests: only what changed since is checked (a
            # request with fewer tokens left cannot use as many drafts).
            remaining = st.remaining[slots]
            ahead = prepared.num_draft
            if prepared.within_caps and (remaining > ahead).all():
                # within the static caps and every request has a token left past its drafts:
                # the caps below would change nothing
                num_draft = ahead
                extra = prepared.expected_accepted
            else:
                caps = np.where(
                    st.spec_code[slots] > 0, np.minimum(remaining - 1, self.config.max_drafts), 0
                )
                num_draft = np.minimum(ahead, np.maximum(caps, 0))
                extra = prepared.expected_accepted if np.array_equal(num_draft, ahead) else None
            reason = prepared.reason + " (ahead)"
            probe = prepared.probe
            ar_ms = self.cost_model.predict_ms_scalar(n, int(st.num_computed[slots].sum()) + n)
        else:
            extra = None
            self.outcomes.flush()
            priced = self.views.round_view(slots, chunks, round_id, cohort_changed)
            decision = policy.decide(priced.view, self.estimator, self.cost_model)
            reason = decision.reason
            probe = decision.probe
            num_draft = np.asarray(decision.num_draft, dtype=np.int64)
            ar_ms = priced.ar_ms
        # Only decode-only rounds feed the rate bar (see RateTracker): with a prefill chunk in
        # the round, drafts ride on an expensive eager forward and the uplift over AR is far
        # above what decode rounds can reach.
        ar_rate = 0.0 if chunks else n / ar_ms
        if extra is None:
            extra = self.expected_accepted(slots, num_draft) if num_draft.any() else 0.0
        return RoundDecision(num_draft, reason, probe, extra, ar_rate)

    def decide_behind(self, slots: np.ndarray, chunks: list[PrefillChunk]) -> RoundDecision:
        """AR for everyone, for a round planned while the advanced round runs."""
        self.prepared = None
        n = len(slots)
        ar_rate = 0.0
        if n and not chunks:
            kv_tokens = int(self.slot_table.num_computed[slots].sum()) + n
            ar_rate = n / self.cost_model.predict_ms_scalar(n, kv_tokens)
        reason = "AR, planned while the previous round runs"
        return RoundDecision(np.zeros(n, dtype=np.int64), reason, False, 0.0, ar_rate)

    def prepare(
        self, policy: SpecPolicy, slots: np.ndarray, round_id: int, cohort_changed: bool
    ) -> None:
        """Decides round `round_id` for the decoding `slots` ahead of its plan; it sees the
        request state and acceptance estimates of one round earlier."""
        self.prepared = None
        self.outcomes.flush()
        if len(slots) == 0 or self.config.max_drafts == 0:
            return
        view = self.views.round_view(slots, (), round_id, cohort_changed).view
        decision = policy.decide(view, self.estimator, self.cost_model)
        # a copy: the plan may hand this very array on (read-only) as the round's depths
        num_draft = np.array(decision.num_draft, dtype=np.int64)
        extra = self.expected_accepted(slots, num_draft) if num_draft.any() else 0.0
        max_drafts = self.config.max_drafts
        within_caps = bool(
            (
                (num_draft >= 0) & (num_draft <= max_drafts) & (view.may_spec | (num_draft == 0))
            ).all()
        )
        self.prepared = PreparedDecision(
            slots=slots,
            req_ids=view.req_ids.copy(),
            num_draft=num_draft,
            reason=decision.reason,
            expected_accepted=extra,
            within_caps=within_caps,
            probe=decision.probe,
        )

    def may_plan_ahead(self) -> bool:
        """Whether the next round may be planned while the advanced one runs: the decision
        made ahead has no request speculating, or no round ever speculates."""
        if self.config.max_drafts == 0 or self.config.spec_mode == "ar":
            return True
        prepared = self.prepared
        return prepared is not None and not prepared.num_draft.any()

    def expected_accepted(self, slots: np.ndarray, num_draft: np.ndarray) -> float:
        """Accepted drafts the estimators expect of these depths, whatever policy chose them."""
        d = self.config.max_drafts
        survival = self.estimator.survival(slots)[:, :d]  # [n, D]
        taken = np.arange(d)[None, :] < num_draft[:, None]
        return float((survival * taken).sum())


def _made_for(prepared: PreparedDecision, slots: np.ndarray, slot_table: SlotTable) -> bool:
    """Whether the decision made ahead is for exactly the requests decoding in `slots`."""
    # the decoding-slot array is rebuilt (a new object) whenever the decoding set changes, so
    # the same object means the same requests
    return prepared.slots is slots or (
        np.array_equal(prepared.slots, slots)
        and np.array_equal(prepared.req_ids, slot_table.req_id[slots])
    )
