"""Round-time prices from a cost profile, uncorrected: `ProfileCost`.

Each price is one formula over the profile's tables (scheduler/profile_tables.py), written
once against a `Form` (scheduler/cost_tables.py): a method prices numpy arrays of shapes, its
`*_scalar` twin one shape in plain Python numbers, and both run the same formula.
`SpecTerms` is the depth planner's form of the speculating terms over many prefixes of one
ranked order. The online correction of these prices is CostModel's (scheduler/cost_model.py).
"""

from __future__ import annotations

import numpy as np

from scheduler.cost_tables import SPEC_TABLE_DRAFTS, SPEC_TABLE_REQS, keyword_twin
from scheduler.profile_tables import ProfileTables

# Host time one more verified row of a grammar-constrained request adds to a round: its token
# mask filled by the grammar library, uploaded and applied, measured on a CPU with a JSON schema
# (docs/perf/structured-outputs.md). The policy charges it per draft row; the fixed part of a
# round's masks is paid whether the request drafts or not.
GRAMMAR_MASK_MS_PER_ROW = 0.027


class ProfileCost(ProfileTables):
    """The uncorrected round prices of a profile JSON."""

    def bucket_index(self, num_rows, *, scalar=False):
        """Shape-bucket id of a row count (len(row_buckets) for eager shapes)."""
        return (self.scalars if scalar else self.arrays).shape_bucket(num_rows)

    @property
    def grammar_mask_ms_per_row(self) -> float:
        """Host ms of one verified row's grammar mask (GRAMMAR_MASK_MS_PER_ROW)."""
        return GRAMMAR_MASK_MS_PER_ROW

    def target_ms(self, num_rows):
        return self.target_curve(num_rows)

    def follow_ms(self, num_rows: int) -> float:
        """A draft model's forward over `num_rows` prefill rows it follows (the catch-up
        curve, as rounds that follow their chunks are priced)."""
        return self.eager_curve.scalar(num_rows)

    def prefill_target_ms(self, num_rows):
        """Target cost of a round with a prefill chunk (eager)."""
        return self.prefill_curve(num_rows)

    def padded_target_ms(self, num_rows):
        """Target cost of a decode-only round: its rows padded to the graph bucket."""
        return self.padded_curve(num_rows)

    def ahead_ratio_scalar(self, num_rows: int) -> float:
        """The factor an AR-only decode round's time takes when it runs ahead."""
        return self.ahead_ratio_table.scalar(num_rows)

    def draft_step_ms(self, num_rows):
        return self.draft_curve(num_rows)

    def attention_ms(self, num_kv_tokens):
        return np.asarray(num_kv_tokens) * self.kv_ms_per_token

    def propose_ms(self, num_spec, *, scalar=False):
        """A model-free drafter's proposal for `num_spec` requests (0 for a draft model)."""
        return (self.scalars if scalar else self.arrays).propose(num_spec)

    def spec_ratio(self, num_spec, *, scalar=False):
        """The profile's `spec_round_ratio` at `num_spec` speculating requests (1 without it)."""
        return (self.scalars if scalar else self.arrays).spec_ratio(num_spec)

    def spec_host_ms(self, num_seqs, *, scalar=False):
        """The engine's host time around a speculating round of `num_seqs` decoding requests."""
        return (self.scalars if scalar else self.arrays).spec_host(num_seqs)

    def ar_restart_ms_scalar(self, num_seqs: int) -> float:
        """The switch back to AR: the first AR round after a speculating round, `num_seqs`
        decoding requests, costs this beyond a steady AR round (the engine launches it ahead
        from an idle pipeline). The engine's, not a round's: the simulator charges it."""
        return self.restart_table.scalar(num_seqs)

    def first_step_ms(self, num_spec, lag_rows, *, scalar=False):
        """The chain's first step: the last committed token of `num_spec` requests plus
        `lag_rows` catch-up rows among them. A drafter with catch-up passes runs
        ceil(rows per request / catchup_rows_per_pass) steps of rows / passes rows each (the
        rows spread evenly over the requests), up to `max_catchup_passes`; past that one eager
        forward of all rows. Without passes, or without lag, one step of all rows."""
        f = self.scalars if scalar else self.arrays
        if not scalar:
            num_spec = np.asarray(num_spec, dtype=np.float64)
            lag_rows = np.asarray(lag_rows, dtype=np.float64)
        rows = num_spec + lag_rows
        if not (self.catchup_rows_per_pass and f.any(lag_rows)):
            return f.draft(rows)
        passes = f.ceil(rows / f.max(num_spec, 1.0) / self.catchup_rows_per_pass)
        one = passes > self.max_catchup_passes
        passes = f.where(one, 1.0, f.max(passes, 1.0))
        return f.where(one, f.eager(rows), passes * f.draft(f.trunc(rows / passes)))

    def catchup_extra_ms(self, num_spec, lag_rows, *, scalar=False):
        """What a catch-up of `lag_rows` adds to the chain's first step: 0 without lag."""
        f = self.scalars if scalar else self.arrays
        if not scalar:
            num_spec, lag_rows = np.asarray(num_spec), np.asarray(lag_rows)
        if not f.any(lag_rows):
            return f.zeros(num_spec, lag_rows)
        extra = self.first_step_ms(num_spec, lag_rows, scalar=scalar) - f.draft(num_spec)
        return f.where(lag_rows > 0, extra, 0.0)

    def catchup_profiled_ms(self, num_spec: int, lag_rows: int) -> float:
        """A catch-up's cost beyond the plain first step as the profile prices it in a
        speculating round (with the round factor): what a drafter's measured catch-up
        (`PhaseTimes.catchup_ms`) stands against."""
        return self.catchup_extra_ms_scalar(num_spec, lag_rows) * self.spec_ratio_scalar(num_spec)

    def chain_ms(self, num_spec, depth, *, scalar=False):
        """The drafter's whole proposal of `depth` drafts for `num_spec` requests without a
        catch-up beyond the usual 1-2 rows: the profile's `propose_ms` table where it has one
        (chain_table), plus d steps' growth of the step curve past its request counts and
        plain steps past its drafts; without it the first step plus (depth - 1) steps."""
        f = self.scalars if scalar else self.arrays
        k, d = num_spec, depth
        if not scalar:
            k, d = np.asarray(k, dtype=np.int64), np.asarray(d, dtype=np.int64)
        if self.chain is None:
            return f.draft(k) + (f.max(d, 1) - 1) * f.draft(f.max(k, 1))
        last = SPEC_TABLE_REQS - 1
        t = f.chain(f.clip(k, 0, last), f.clip(d, 0, SPEC_TABLE_DRAFTS))
        if f.any(k > last):
            t = t + f.where(k > last, d * (f.draft(k) - f.draft(last)), 0.0)
        if f.any(d > SPEC_TABLE_DRAFTS):
            deeper = (d - SPEC_TABLE_DRAFTS) * f.draft(f.max(k, 1))
            t = t + f.where(d > SPEC_TABLE_DRAFTS, deeper, 0.0)
        return t

    def spec_excess_ms(self, num_spec, num_draft_rows, *, scalar=False):
        """The target's cost beyond the AR curve of `num_spec` speculating requests verifying
        `num_draft_rows` drafts in all (0 without `spec_rows_ms`): excess(k, 1 + D / k) of
        excess_table, linear in the rows per sequence between its points, proportional to k
        past its last count, 0 without speculating requests. A pure speculating round of a
        profiled shape thus costs its measurement exactly, and AR rows and padding beside the
        groups cost the difference of the target curve."""
        f = self.scalars if scalar else self.arrays
        k = num_spec
        if not scalar:
            k = np.asarray(k, dtype=np.int64)
            num_draft_rows = np.asarray(num_draft_rows, dtype=np.float64)
        if self.excess is None:
            return f.zeros(k, num_draft_rows)
        last = SPEC_TABLE_REQS - 1
        kc = f.clip(k, 1, last)
        per_seq = 1.0 + num_draft_rows / kc
        r = self.excess_rows_per_seq
        j = f.clip(f.search(r, per_seq) - 1, 0, r.width - 2)
        lo, hi = f.excess(kc, j), f.excess(kc, j + 1)
        y = lo + (per_seq - f.excess_r(j)) / f.excess_width(j) * (hi - lo)
        return y * f.where(k > last, k / last, k > 0)

    def draft_kv_ms(self, num_draft_rows, decode_kv_tokens, num_decoding, *, scalar=False):
        """What `num_draft_rows` drafts cost beyond their proposal's price at the profile's
        reference context, for decoding requests of `decode_kv_tokens` tokens of KV in all
        (`num_decoding` of them): each draft's step reads its request's draft KV, priced at the
        batch's mean context, D * kv_ms_per_token * (T / n - context_len) (0 without the
        rate; negative below the reference context). Without the term a proposal at long
        contexts is priced as at the reference context, and the planner takes more drafts
        there than at short ones (more of such a round is the target's KV read, which drafts
        do not add to). round_ms takes T as the round's KV less its draft and prefill rows:
        next to a later chunk of a prompt it still holds that prompt's computed prefix, a
        slight over-estimate."""
        f = self.scalars if scalar else self.arrays
        if not self.draft_kv_ms_per_token:
            return f.zeros(num_draft_rows, decode_kv_tokens)
        if not scalar:
            num_draft_rows = np.asarray(num_draft_rows)
            decode_kv_tokens = np.asarray(decode_kv_tokens, dtype=np.float64)
        context = decode_kv_tokens / f.max(num_decoding, 1)
        rate = self.draft_kv_ms_per_token
        return rate * num_draft_rows * (context - self.draft_context_len)

    def round_spec_host_ms(
        self, num_rows, num_prefill_rows, num_spec, draft_depth, num_draft_rows=None, *, scalar=True
    ):
        """spec_host_ms of a speculating round given as round_ms takes it (one shape unless
        `scalar` is off): its decoding requests are its rows less prefill and draft rows
        (`num_draft_rows`, default num_spec x draft_depth), at least its speculating ones."""
        f = self.scalars if scalar else self.arrays
        drafts = num_spec * draft_depth if num_draft_rows is None else num_draft_rows
        return f.spec_host(f.max(num_rows - num_prefill_rows - drafts, num_spec))

    def round_ms(
        self,
        num_rows,
        num_kv_tokens,
        draft_depth=0,
        num_spec=0,
        drafter_lag_rows=0,
        num_prefill_rows=0,
        drafter_prefill=False,
        num_draft_rows=None,
        padded=False,
        executor_only=False,
        *,
        scalar=False,
    ):
        """Uncorrected round time in ms, of broadcast arrays of shapes (`scalar`: of one shape
        in plain Python numbers, the default of round_ms_scalar):

            target(bucket(rows)) + kv_tokens * kv_ms_per_token      [x ahead ratio: AR decode]
              + first step + (d_max - 1) chain steps  |  proposal table + catch-up passes
              + engine host time + model-free proposal + excess of the groups + draft KV
              + the drafter's forward over the prefill rows it follows
            all x spec ratio                                        [speculating rounds]

        Decode-only rounds are padded to their graph bucket (`padded`: num_rows is already the
        executed row count); rounds with a prefill chunk run eagerly (the prefill curve). The
        chain over num_spec requests costs d_max steps, the first with the catch-up rows
        (first_step_ms); a profile with a proposal table prices the chain from it (chain_ms)
        and a catch-up's passes on top. The engine's host time is by decoding requests
        (round_spec_host_ms). `num_draft_rows`: the round's draft rows (default
        num_spec * draft_depth). `executor_only`: less the engine's host time around a
        speculating round, the part an executor's own measured time stands for."""
        f = self.scalars if scalar else self.arrays
        if not scalar:
            num_rows, num_kv_tokens = np.asarray(num_rows), np.asarray(num_kv_tokens)
            num_prefill_rows = np.asarray(num_prefill_rows)
            draft_depth = np.asarray(draft_depth, dtype=np.int64)
            num_spec = np.asarray(num_spec, dtype=np.int64)
        t = f.target(num_rows) if padded else f.padded(num_rows)
        kv_ms = num_kv_tokens * self.kv_ms_per_token
        prefilling, spec = num_prefill_rows > 0, draft_depth > 0
        if not f.any(spec | prefilling):  # AR decode rounds only: every one runs ahead
            return (t + kv_ms) * f.ahead_ratio(num_rows)
        rows, kv, dd, k, prefill = num_rows, num_kv_tokens, draft_depth, num_spec, num_prefill_rows
        any_prefill, any_spec = f.any(prefilling), f.any(spec)
        if any_prefill:
            t = f.where(prefilling, f.prefill(rows), t)
        t = t + kv_ms
        ahead = (dd == 0) & (prefill == 0)
        if f.any(ahead):
            t = t * f.where(ahead, f.ahead_ratio(rows), 1.0)
        if any_spec:
            lag = drafter_lag_rows if scalar else np.asarray(drafter_lag_rows)
            if self.chain is None:
                first = self.first_step_ms(k, lag, scalar=scalar)
                rest = (f.max(dd, 1) - 1) * f.draft(f.max(k, 1))
            else:
                first = self.chain_ms(k, dd, scalar=scalar)
                rest = self.catchup_extra_ms(k, lag, scalar=scalar)
            host = self.round_spec_host_ms(rows, prefill, k, dd, num_draft_rows, scalar=scalar)
            s = t + first + rest + host + f.propose(k)
            drafts = k * dd if num_draft_rows is None else num_draft_rows
            if self.excess is not None:
                s = s + self.spec_excess_ms(k, drafts, scalar=scalar)
            if self.draft_kv_ms_per_token:
                decode_kv = f.max(kv - drafts - prefill, 0)
                seqs = rows - prefill - drafts
                s = s + self.draft_kv_ms(drafts, decode_kv, seqs, scalar=scalar)
            t = f.where(spec, s, t)
        if drafter_prefill and any_prefill:
            # (one wide forward of the draft model over the chunks: the catch-up curve)
            t = t + f.where(prefilling, f.eager(prefill), 0.0)
        if any_spec:
            # (the spec ratio prices the round with the host time in it)
            ratio = f.spec_ratio(k)
            t = f.where(spec, t * ratio - host if executor_only else t * ratio, t)
        return t

    # The one-shape forms: the same code with `scalar` on (keyword_twin: no call in between).
    bucket_index_scalar = keyword_twin(bucket_index, "bucket_index_scalar", scalar=True)
    propose_ms_scalar = keyword_twin(propose_ms, "propose_ms_scalar", scalar=True)
    spec_ratio_scalar = keyword_twin(spec_ratio, "spec_ratio_scalar", scalar=True)
    spec_host_ms_scalar = keyword_twin(spec_host_ms, "spec_host_ms_scalar", scalar=True)
    first_step_ms_scalar = keyword_twin(first_step_ms, "first_step_ms_scalar", scalar=True)
    catchup_extra_ms_scalar = keyword_twin(catchup_extra_ms, "catchup_extra_ms_scalar", scalar=True)
    chain_ms_scalar = keyword_twin(chain_ms, "chain_ms_scalar", scalar=True)
    spec_excess_ms_scalar = keyword_twin(spec_excess_ms, "spec_excess_ms_scalar", scalar=True)
    draft_kv_ms_scalar = keyword_twin(draft_kv_ms, "draft_kv_ms_scalar", scalar=True)
    round_ms_scalar = keyword_twin(round_ms, "round_ms_scalar", scalar=True)

    def spec_terms_ms(self, num_spec, num_draft_rows, depth):
        """Everything the speculating set adds to a round beyond its rows' target cost, KV and
        the engine's host time, without catch-ups: the target's excess for the groups, the
        drafter's proposal (chain_ms) and a model-free drafter's host time. Arrays; the
        planner prices a candidate as corr * (fixed + spec_terms + catch-up) (spec_row_terms)."""
        return (
            self.chain_ms(num_spec, depth)
            + self.propose_ms(num_spec)
            + self.spec_excess_ms(num_spec, num_draft_rows)
        )

    def spec_terms(self, num_spec) -> SpecTerms:
        """spec_terms_ms of the prefixes of one ranked order of draft positions, `num_spec`
        [P] speculating requests of each, set up once for the planner's loop over caps."""
        return SpecTerms(self, num_spec)


class SpecTerms:
    """ProfileCost.spec_terms_ms over subsets of P prefixes (one ranked order of draft
    positions, `num_spec` [P] speculating requests of each): the request-count lookups are done
    once, so each of the planner's caps pays a few gathers over its own positions (arrays of at
    most P entries, as the planner keeps them). The excess is read as intercept + D * slope of
    its segment (the same piecewise-linear function, ProfileTables.excess_slope)."""

    def __init__(self, profile: ProfileCost, num_spec):
        self.profile = profile
        self.num_spec = np.asarray(num_spec, dtype=np.int64)  # [P]
        k = self.num_spec
        self.propose = profile.propose_ms(k)  # [P] model-free drafter's host time
        self.has_propose = bool(self.propose.any())
        self.in_table = k.max(initial=0) < SPEC_TABLE_REQS
        self.table = self.in_table and profile.chain is not None
        if not self.table:  # first_step(k, 0) + (d - 1) steps, or beyond the table's counts
            self.first = profile.draft_curve(k) + self.propose  # [P]
            self.step = profile.draft_curve(np.maximum(k, 1))  # [P]
        self.excess = profile.excess is not None
        if self.excess and self.in_table:
            # drafts per request at the breaks (whole rows per sequence: integer compares)
            breaks = profile.excess_rows_per_seq.values[1:-1] - 1.0
            integral = np.all(breaks == np.round(breaks))
            self.segment_rows = breaks.astype(np.int64).tolist() if integral else breaks.tolist()
            self.slope = profile.excess_slope.ravel()  # [SPEC_TABLE_REQS * (J - 1)]
            self.intercept = profile.excess_intercept.ravel()
            self.num_segments = profile.excess_slope.shape[1]

    def __call__(self, taken: np.ndarray, num_draft_rows, depth: int) -> np.ndarray:
        """[m] spec_terms_ms of the prefixes `taken` [m] with their draft rows, at `depth`."""
        p = self.profile
        if self.table and depth <= SPEC_TABLE_DRAFTS:
            t = p.chain.values[:, depth].take(self.num_spec.take(taken))
            if self.has_propose:
                t = t + self.propose.take(taken)
        elif p.chain is None:
            t = self.first.take(taken) + (depth - 1) * self.step.take(taken)
        else:
            t = p.chain_ms(self.num_spec.take(taken), depth) + self.propose.take(taken)
        if self.excess and self.in_table:
            k = self.num_spec.take(taken)  # [m]
            idx = k * self.num_segments  # [m] the request count's first segment
            for rows_per_req in self.segment_rows:
                idx += num_draft_rows > (k if rows_per_req == 1 else k * rows_per_req)
            t = t + (self.intercept.take(idx) + num_draft_rows * self.slope.take(idx))
        elif self.excess:
            t = t + p.spec_excess_ms(self.num_spec.take(taken), num_draft_rows)
        return t
