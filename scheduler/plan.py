"""The round contract between the scheduler (policy) and the executor (device work).

Everything here is torch-free and immutable. The executor imports only this module from
`scheduler/`. One round:

    Scheduler.plan(now) -> RoundPlan; Executor.run(plan) -> RoundResult; Scheduler.update(result)

Ownership:
- The scheduler owns request state (prompt, outputs, KV length) and the KV *block ids*
  (`scheduler/kv_blocks.py`): it allocates blocks for every row a round writes (prefill chunk,
  AR row, spec rows incl. drafts) before the round and frees the ones past the committed end after
  it. The executor owns the KV *tensors* and per-slot device state (block table rows, last token,
  sequence length, sampling parameters, drafter state) and writes where the plan says.
- A slot is a fixed row index `0 <= slot < max_concurrency` into the executor's per-slot tables.
  A request keeps its slot from setup until release.
- The executor never decides policy; the scheduler never touches tensors.

Row accounting of one round: `sum(r.num_new for r in reqs)` rows. A SPEC request with
`num_draft = d` contributes `1 + d` rows: its last committed token plus `d` drafted tokens, so a
spec depth of D (rows per spec request) means at most `D - 1` drafts.
"""

from __future__ import annotations

import enum

import msgspec


class Mode(enum.IntEnum):
    PREFILL = 0  # a chunk of the request's context (prompt, or prompt + outputs after preemption)
    AR = 1  # one new row: the last committed token, yields one token
    SPEC = 2  # 1 + num_draft rows verified in the same forward, yields 1 + accepted tokens


ROUTE_LETTER = {Mode.PREFILL: "P", Mode.AR: "A", Mode.SPEC: "S"}


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class SeqSetup(msgspec.Struct, frozen=True, kw_only=True):
    """A request entering a slot: new, or resumed after preemption (then `context_token_ids`
    holds prompt + tokens generated so far, all recomputed by PREFILL chunks)."""

    req_id: int
    slot: int
    context_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    num_output_tokens: int = 0  # outputs already inside context_token_ids (resume), for penalties


class ReqPlan(msgspec.Struct, frozen=True, kw_only=True):
    req_id: int
    slot: int
    mode: Mode
    num_computed: int  # tokens whose KV is valid before this round (committed length)
    num_new: int  # rows this round: chunk length (PREFILL), 1 (AR), 1 + num_draft (SPEC)
    num_draft: int = 0  # SPEC only; at most spec_depth - 1
    block_offset: int = 0  # index in the slot's block table where new_block_ids go
    new_block_ids: tuple[int, ...] = ()  # appended at block_offset before the forward
    sample: bool = True  # False for a PREFILL chunk that does not reach the end of the context


class RoundPlan(msgspec.Struct, frozen=True, kw_only=True):
    round_id: int
    setup: tuple[SeqSetup, ...] = ()  # applied before `reqs`
    release: tuple[int, ...] = ()  # slots freed (finished, aborted, preempted) before `reqs`
    reqs: tuple[ReqPlan, ...] = ()
    num_rows: int = 0  # sum of num_new
    row_bucket: int = 0  # rows padded to this for graph replay (0: no padding, eager)
    num_kv_tokens: int = 0  # sum over reqs of num_computed + num_new
    spec_depth: int = 1  # deepest rows per spec request this round (drafter chain length + 1)
    predicted_ms: float = 0.0
    predicted_tokens: float = 0.0
    route: str = ""  # one letter per live request in reqs order: P, A or S
    reason: str = ""  # why this route (human readable, for logs and metrics)

    @property
    def is_decode_only(self) -> bool:
        return all(r.mode != Mode.PREFILL for r in self.reqs)


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


class ReqResult(msgspec.Struct, frozen=True, kw_only=True):
    req_id: int
    token_ids: tuple[int, ...]  # emitted: accepted drafts, then the correction/bonus token
    num_drafted: int = 0
    num_accepted: int = 0  # accepted draft prefix length (chain): positions 1..num_accepted
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token when asked


class PhaseTimes(msgspec.Struct, frozen=True, kw_only=True):
    build_ms: float = 0.0  # host batch build and uploads
    draft_ms: float = 0.0  # drafter proposals, catch-up included
    catchup_ms: float = 0.0  # part of draft_ms spent catching the drafter up after AR rounds
    forward_ms: float = 0.0  # the one target forward
    accept_ms: float = 0.0  # on-device acceptance and the copy of counts/tokens to host
    commit_ms: float = 0.0  # sequence-length advance and drafter bookkeeping
    total_ms: float = 0.0  # wall time of Executor.run


class RoundResult(msgspec.Struct, frozen=True, kw_only=True):
    round_id: int
    reqs: tuple[ReqResult, ...]
    timings: PhaseTimes
    num_rows: int
    num_padded_rows: int
    num_kv_tokens: int
    graph_replayed: bool = False
