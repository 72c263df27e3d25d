"""What the speculation policy sees of a round: the `DecodeView` of its decoding requests, and
the predicted time of the round's all-AR alternative that its rate bar is measured against."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np

from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostModel
from scheduler.lifecycle import RequestLifecycle
from scheduler.plan import Mode
from scheduler.policy import RateTracker, YieldTracker
from scheduler.policy_api import DecodeView
from scheduler.prefill_chunks import PrefillChunk
from scheduler.slot_table import SPECULATION_CODE, SlotTable


class PricedView(msgspec.Struct, frozen=True):
    view: DecodeView
    ar_ms: float  # predicted time of the round with every decoding request in AR


class PolicyViews:
    def __init__(
        self,
        config: SchedulerConfig,
        slot_table: SlotTable,
        lifecycle: RequestLifecycle,
        cost_model: CostModel,
        rate_tracker: RateTracker,
        yield_tracker: YieldTracker,
    ):
        self.config = config
        self.slot_table = slot_table
        self.lifecycle = lifecycle
        self.cost_model = cost_model
        self.rate_tracker = rate_tracker
        self.yield_tracker = yield_tracker

    def round_view(
        self,
        slots: np.ndarray,
        chunks: list[PrefillChunk] | tuple[()],
        round_id: int,
        cohort_changed: bool,
    ) -> PricedView:
        """The view of a round that decodes `slots` next to the prefill `chunks`."""
        n = len(slots)
        cfg = self.config
        st = self.slot_table
        remaining = st.remaining[slots]
        last_mode = st.last_mode[slots]
        spec_code = st.spec_code[slots]
        num_live = len(self.lifecycle.live)
        # Drain: nobody waits and slots are free, so capacity is not what limits the server;
        # the live requests finishing is. The last to finish sets the makespan, so a token is
        # worth its request's share of the largest remaining work.
        draining = self.lifecycle.admission.num_waiting == 0 and num_live < cfg.max_concurrency
        if draining:
            weights = remaining / max(int(remaining.max()), 1)
        else:
            weights = np.ones(n)
        num_prefill_rows = sum(c.num_new for c in chunks)
        prefill_done = sum(1 for c in chunks if c.completes)
        base_rows = n + num_prefill_rows
        base_kv_tokens = (
            int(st.num_computed[slots].sum())
            + n
            + sum(c.req.num_computed + c.num_new for c in chunks)
        )
        base_tokens = float(weights.sum()) + prefill_done
        ar_ms = self.cost_model.predict_ms_scalar(
            base_rows, base_kv_tokens, 0, 0, 0, num_prefill_rows
        )
        view = DecodeView(
            req_ids=st.req_id[slots],
            slots=slots,
            num_remaining=remaining,
            drafter_lag=st.drafter_lag[slots],
            may_spec=spec_code > 0,
            must_spec=spec_code == 2,
            was_spec=last_mode == Mode.SPEC,
            # a request's first decode round has no mode to hold on to yet
            in_dwell=(round_id - st.mode_since[slots] < cfg.min_dwell_rounds)
            & (last_mode != Mode.PREFILL),
            weights=weights,
            max_drafts=cfg.max_drafts,
            base_rows=base_rows,
            base_kv_tokens=base_kv_tokens,
            base_tokens=base_tokens,
            num_prefill_rows=num_prefill_rows,
            num_live=num_live,
            cohort_changed=cohort_changed,
            draining=draining,
            rate_bar=self.rate_tracker.uplift * base_tokens / ar_ms,
            yield_factor=self.yield_tracker.factor,
            row_host_ms=self._row_host_ms(st.grammar[slots]),
        )
        return PricedView(view, ar_ms)

    def _row_host_ms(self, grammar: np.ndarray) -> np.ndarray | None:
        """[n] host ms per verified row: a grammar's mask for the requests that have one."""
        if not grammar.any():
            return None
        return grammar * self.cost_model.profile.grammar_mask_ms_per_row

    def steady_view(self, round_id: int, cohort_changed: bool) -> DecodeView:
        """The view of the live batch as it will decode: every live request decoding, those
        still in prefill with their whole prompt computed, at the global prior (their
        estimators start there), out of any dwell, their drafters caught up."""
        st = self.slot_table
        live = [r for r in self.lifecycle.live if r.slot >= 0]
        slots = np.array([r.slot for r in live], dtype=np.int64)
        view = self.round_view(slots, (), round_id, cohort_changed).view
        pre = np.flatnonzero(~st.decoding[slots])  # positions of prefilling requests
        if not len(pre):
            return view
        reqs = [live[i] for i in pre]
        code = np.array([SPECULATION_CODE[r.spec.speculation] for r in reqs], dtype=np.int64)

        def put(column: np.ndarray, values) -> np.ndarray:
            out = column.copy()
            out[pre] = values
            return out

        n = len(slots)
        grammar = put(st.grammar[slots], [r.spec.sampling.grammar is not None for r in reqs])
        decoding = slots[st.decoding[slots]]
        kv = int(st.num_computed[decoding].sum()) + sum(r.num_prefill_target for r in reqs) + n
        ar_ms = self.cost_model.predict_ms_scalar(n, kv)
        return replace(
            view,
            num_remaining=put(view.num_remaining, [r.num_remaining for r in reqs]),
            drafter_lag=put(view.drafter_lag, 0),
            may_spec=put(view.may_spec, code > 0),
            must_spec=put(view.must_spec, code == 2),
            was_spec=put(view.was_spec, False),
            in_dwell=put(view.in_dwell, False),
            weights=np.ones(n),
            base_kv_tokens=kv,
            base_tokens=float(n),
            draining=False,
            rate_bar=self.rate_tracker.uplift * n / ar_ms,
            row_host_ms=self._row_host_ms(grammar),
        )
