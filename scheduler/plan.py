"""The round contract between the scheduler (policy) and the executor (device work).

Torch-free and immutable; the executor imports only this module from `scheduler/`. One round:

    Scheduler.plan(now) -> RoundPlan; Executor.run(plan) -> RoundResult; Scheduler.update(result)

The scheduler owns request state (prompt, outputs, KV length) and the KV *block ids*
(`scheduler/kv_blocks.py`): it allocates blocks for every row a round writes (prefill chunk, AR
row, spec rows incl. drafts) before the round and frees the ones past the committed end after it.
The executor owns the KV *tensors* and per-slot device state (block table rows, last token,
sequence length, sampling parameters, drafter state) and writes where the plan says. A slot is a
fixed row index `0 <= slot < max_concurrency` into the executor's per-slot tables, kept by a
request from setup until release. The executor never decides policy; the scheduler never
touches tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np


class Mode(enum.IntEnum):
    PREFILL = 0  # a chunk of the request's context (prompt, or prompt + outputs after preemption)
    AR = 1  # one new row: the last committed token, yields one token
    SPEC = 2  # 1 + num_draft rows verified in the same forward, yields 1 + accepted tokens


ROUTE_LETTER = {Mode.PREFILL: "P", Mode.AR: "A", Mode.SPEC: "S"}


def frozen_array(values, dtype=np.int64) -> np.ndarray:
    """A read-only contiguous array (a copy unless `values` already is one of that dtype)."""
    arr = np.ascontiguousarray(values, dtype=dtype)
    arr.setflags(write=False)
    return arr


_ZERO = np.zeros(1, dtype=np.int64)  # [1] the first start of `offsets`


def offsets(counts: np.ndarray) -> np.ndarray:
    """[n] counts -> [n + 1] int64 starts: item i spans [starts[i], starts[i + 1])."""
    return np.concatenate((_ZERO, np.asarray(counts, dtype=np.int64))).cumsum()


class GrammarSpec(msgspec.Struct, frozen=True):
    """A constraint on a request's output text, as the grammar library reads it (the executor
    compiles it: `executor/structured/grammar.py`). Equal specs share one compiled grammar."""

    kind: str  # "json" (a JSON schema), "json_object", "regex", "choice", "grammar" (Lark/GBNF)
    source: str = ""  # the schema as JSON text, the regex, the choices as a JSON list, the grammar


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling, as the executor applies it on the device."""

    temperature: float = 0.0  # 0 means greedy (argmax); exact-match verification then
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # per-request generator: same seed, same output
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token + top-k alternatives
    # (token id, bias) added to the raw logits of every row the request samples or verifies
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the output must match it: every such row is masked to the tokens the grammar allows
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class SeqSetup(msgspec.Struct, frozen=True, kw_only=True):
    """A request entering a slot: new, or resumed after preemption (then `context_token_ids`
    holds prompt + tokens generated so far, recomputed by PREFILL chunks). A context whose
    prefix is in the prefix cache starts with `num_cached_tokens` positions computed: its table
    begins with `cached_block_ids` (shared read-only: no round writes the target's KV there)
    and its first chunk starts after them."""

    req_id: int
    slot: int
    context_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    num_output_tokens: int = 0  # outputs already inside context_token_ids (resume), for penalties
    cached_block_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0  # len(cached_block_ids) * block_size, < len(context_token_ids)


class ReqPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One request's part of a round, as an object: PREFILL chunks travel like this; decode
    requests travel as `DecodeRows` columns (`DecodeRows.plan(i)` gives this view of one)."""

    req_id: int
    slot: int
    mode: Mode
    num_computed: int  # tokens whose KV is valid before this round (committed length)
    num_new: int  # rows this round: chunk length (PREFILL), 1 (AR), 1 + num_draft (SPEC)
    num_draft: int = 0  # SPEC only; at most spec_depth - 1
    block_offset: int = 0  # index in the slot's block table where new_block_ids go
    new_block_ids: tuple[int, ...] = ()  # appended at block_offset before the forward
    sample: bool = True  # False for a PREFILL chunk that does not reach the end of the context


class DecodeRows(msgspec.Struct, frozen=True, kw_only=True):
    """The decoding requests of a round as read-only int64 columns, one entry per request.

    Request i is AR when `num_draft[i] == 0` (one row: its last committed token), else SPEC with
    `1 + num_draft[i]` rows. Its new KV block ids are
    `new_block_ids[block_starts[i]:block_starts[i + 1]]`, written into its slot's block table
    from index `block_offset[i]` on."""

    req_ids: np.ndarray  # [n]
    slots: np.ndarray  # [n]
    num_computed: np.ndarray  # [n] committed length before the round
    num_draft: np.ndarray  # [n] 0: AR
    block_offset: np.ndarray  # [n]
    block_starts: np.ndarray  # [n + 1]
    new_block_ids: np.ndarray  # [block_starts[-1]]

    @classmethod
    def build(
        cls,
        req_ids,
        slots,
        num_computed,
        num_draft,
        block_offset=None,
        block_counts=None,
        new_block_ids=(),
    ) -> DecodeRows:
        n = len(req_ids)
        zeros = np.zeros(n, dtype=np.int64)
        return cls(
            req_ids=frozen_array(req_ids),
            slots=frozen_array(slots),
            num_computed=frozen_array(num_computed),
            num_draft=frozen_array(num_draft),
            block_offset=frozen_array(zeros if block_offset is None else block_offset),
            block_starts=frozen_array(offsets(zeros if block_counts is None else block_counts)),
            new_block_ids=frozen_array(new_block_ids),
        )

    @classmethod
    def empty(cls) -> DecodeRows:
        return cls.build((), (), (), ())

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def num_new(self) -> np.ndarray:
        """[n] rows per request."""
        return self.num_draft + 1

    def plan(self, i: int) -> ReqPlan:
        """Request i as a `ReqPlan` (tests and slow paths; hot paths read the columns)."""
        d = int(self.num_draft[i])
        a, b = int(self.block_starts[i]), int(self.block_starts[i + 1])
        return ReqPlan(
            req_id=int(self.req_ids[i]),
            slot=int(self.slots[i]),
            mode=Mode.SPEC if d > 0 else Mode.AR,
            num_computed=int(self.num_computed[i]),
            num_new=1 + d,
            num_draft=d,
            block_offset=int(self.block_offset[i]),
            new_block_ids=tuple(int(x) for x in self.new_block_ids[a:b]),
        )


class RoundPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One round's work.

    The decode part (one AR row or one speculative group per decoding request, the bulk of every
    round at high concurrency) travels as columns, read-only numpy arrays with one entry per
    request (`DecodeRows`), so neither side spends interpreter time per request on it. PREFILL
    chunks, few per round, stay one `ReqPlan` each. Rows are laid out in that order: the decode
    requests in column order, then the prefill chunks; the result (`RoundResult.out`) has one row
    per planned request in the same order.

    A round has `sum(r.num_new for r in reqs)` rows. A SPEC request with `num_draft = d`
    contributes `1 + d` rows: its last committed token plus `d` drafted tokens, so a spec depth
    of D (rows per spec request) means at most `D - 1` drafts."""

    round_id: int
    setup: tuple[SeqSetup, ...] = ()  # applied before the rows
    release: tuple[int, ...] = ()  # slots freed (finished, aborted, preempted) before the rows
    decode: DecodeRows = msgspec.field(default_factory=DecodeRows.empty)
    prefills: tuple[ReqPlan, ...] = ()  # PREFILL chunks, laid out after the decode rows
    # the drafter computes these chunks' draft KV in this round (those that continue it)
    follow_prefill: bool = False
    num_rows: int = 0  # sum of num_new
    row_bucket: int = 0  # rows padded to this for graph replay (0: no padding, eager)
    num_kv_tokens: int = 0  # sum over requests of num_computed + num_new
    spec_depth: int = 1  # deepest rows per spec request this round (drafter chain length + 1)
    # rows the speculating requests' drafters have not seen (their catch-up, priced in
    # predicted_ms)
    drafter_lag_rows: int = 0
    predicted_ms: float = 0.0
    predicted_tokens: float = 0.0
    route: str = ""  # one letter per planned request in row order: P, A or S
    reason: str = ""  # why this route (human readable, for logs and metrics)
    # the policy's probe of a drafter (scheduler-side: its outcomes weigh more in calibration)
    probe: bool = False

    @classmethod
    def from_reqs(cls, reqs: Iterable[ReqPlan], **fields) -> RoundPlan:
        """A plan from per-request objects (tools and tests): AR/SPEC requests become the decode
        columns in their given order, PREFILL chunks keep theirs after them."""
        reqs = list(reqs)
        dec = [r for r in reqs if r.mode != Mode.PREFILL]
        decode = DecodeRows.build(
            [r.req_id for r in dec],
            [r.slot for r in dec],
            [r.num_computed for r in dec],
            [r.num_draft if r.mode == Mode.SPEC else 0 for r in dec],
            [r.block_offset for r in dec],
            [len(r.new_block_ids) for r in dec],
            [b for r in dec for b in r.new_block_ids],
        )
        prefills = tuple(r for r in reqs if r.mode == Mode.PREFILL)
        return cls(decode=decode, prefills=prefills, **fields)

    @property
    def num_reqs(self) -> int:
        return len(self.decode) + len(self.prefills)

    @property
    def reqs(self) -> tuple[ReqPlan, ...]:
        """Every planned request in row order, as objects (tests and slow paths)."""
        dec = self.decode
        return tuple(dec.plan(i) for i in range(len(dec))) + self.prefills

    @property
    def is_decode_only(self) -> bool:
        return not self.prefills


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


class ReqResult(msgspec.Struct, frozen=True, kw_only=True):
    """One request's part of a result, as an object (`Emitted.result(i)`; tests, slow paths)."""

    req_id: int
    token_ids: tuple[int, ...]  # emitted: accepted drafts, then the correction/bonus token
    num_drafted: int = 0
    num_accepted: int = 0  # accepted draft prefix length (chain): positions 1..num_accepted
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token when asked


class Emitted(msgspec.Struct, frozen=True, kw_only=True):
    """What a round emitted, one row per planned request in the plan's row order, as read-only
    int64 columns. Row i emitted `token_ids[token_starts[i]:token_starts[i + 1]]` (none for a
    PREFILL chunk that does not sample). Logprobs only for the rows that asked: row -> one
    `TokenLogprob` per emitted token."""

    req_ids: np.ndarray  # [n]
    token_starts: np.ndarray  # [n + 1]
    token_ids: np.ndarray  # [token_starts[-1]]
    num_drafted: np.ndarray  # [n]
    num_accepted: np.ndarray  # [n]
    logprobs: dict[int, tuple[TokenLogprob, ...]] = msgspec.field(default_factory=dict)

    @classmethod
    def build(
        cls, req_ids, num_emitted, token_ids, num_drafted, num_accepted, logprobs=None
    ) -> Emitted:
        return cls(
            req_ids=frozen_array(req_ids),
            token_starts=frozen_array(offsets(np.asarray(num_emitted, dtype=np.int64))),
            token_ids=frozen_array(token_ids),
            num_drafted=frozen_array(num_drafted),
            num_accepted=frozen_array(num_accepted),
            logprobs=logprobs or {},
        )

    @classmethod
    def from_results(cls, results: Sequence[ReqResult]) -> Emitted:
        return cls.build(
            [r.req_id for r in results],
            [len(r.token_ids) for r in results],
            [t for r in results for t in r.token_ids],
            [r.num_drafted for r in results],
            [r.num_accepted for r in results],
            {i: r.logprobs for i, r in enumerate(results) if r.logprobs is not None},
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def num_emitted(self) -> np.ndarray:
        return np.diff(self.token_starts)

    def result(self, i: int) -> ReqResult:
        a, b = int(self.token_starts[i]), int(self.token_starts[i + 1])
        return ReqResult(
            req_id=int(self.req_ids[i]),
            token_ids=tuple(int(t) for t in self.token_ids[a:b]),
            num_drafted=int(self.num_drafted[i]),
            num_accepted=int(self.num_accepted[i]),
            logprobs=self.logprobs.get(i),
        )


class PhaseTimes(msgspec.Struct, frozen=True, kw_only=True):
    build_ms: float = 0.0  # host batch build and uploads
    draft_ms: float = 0.0  # drafter proposals, catch-up included
    catchup_ms: float = 0.0  # part of draft_ms spent catching the drafter up after AR rounds
    draft_wait_ms: float = 0.0  # part of draft_ms the host waited for the drafts' device work
    forward_ms: float = 0.0  # the one target forward
    accept_ms: float = 0.0  # on-device acceptance and the copy of counts/tokens to host
    commit_ms: float = 0.0  # sequence-length advance and drafter bookkeeping
    total_ms: float = 0.0  # wall time of Executor.run


class RoundResult(msgspec.Struct, frozen=True, kw_only=True):
    round_id: int
    out: Emitted
    timings: PhaseTimes
    num_rows: int
    num_padded_rows: int
    num_kv_tokens: int
    graph_replayed: bool = False
    # the next round was launched before this one finished (an advanced AR round): its time is
    # its share of overlapped wall time, the period the cost model prices AR rounds run ahead at
    overlapped: bool = False

    @property
    def reqs(self) -> tuple[ReqResult, ...]:
        """Every row of `out` as an object (tests and slow paths)."""
        return tuple(self.out.result(i) for i in range(len(self.out)))
