"""Requests as the scheduler sees them: what the engine submits, what a round gives back, and the
mutable per-request state the scheduler keeps between rounds."""

from __future__ import annotations

import enum

import msgspec

from scheduler.plan import Mode, SamplingSpec, TokenLogprob

SPECULATION_CHOICES = ("off", "on", "auto")


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A request as the engine submits it (already validated and clamped by its tenant)."""

    req_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()  # empty when ignore_eos
    stop_token_ids: tuple[int, ...] = ()
    tenant: str = "default"
    speculation: str = "auto"  # off | on | auto (already clamped by the tenant)
    arrival_time: float = 0.0


class RequestDelta(msgspec.Struct, frozen=True, kw_only=True):
    """What one round added to one request, after stop truncation."""

    req_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None = None  # token id or stop string
    num_drafted: int = 0  # this round
    num_accepted: int = 0


class ReqState(enum.IntEnum):
    WAITING = 0  # in its tenant's queue (new, or preempted and waiting to be recomputed)
    PREFILLING = 1  # holds a slot; context chunks are being computed
    DECODING = 2  # holds a slot; one AR row or a speculative chain per round
    FINISHED = 3
    ABORTED = 4


class Request:
    """Mutable bookkeeping of one request. Token positions: the context is
    `prompt + outputs`; `num_computed` positions have valid KV. While decoding,
    `num_computed == len(context) - 1`: the last token is the next round's input row."""

    __slots__ = (
        "admit_seq",
        "admit_time",
        "drafter_lag",
        "finish_reason",
        "last_mode",
        "mode_since_round",
        "num_accepted",
        "num_computed",
        "num_drafted",
        "num_preemptions",
        "num_prefill_target",
        "output_token_ids",
        "req_id",
        "slot",
        "spec",
        "state",
        "stop_reason",
    )

    def __init__(self, spec: RequestSpec):
        self.spec = spec
        self.req_id = spec.req_id  # a plain attribute: read for every request every round
        self.state = ReqState.WAITING
        self.slot = -1
        self.output_token_ids: list[int] = []
        self.num_computed = 0
        self.num_prefill_target = 0  # context length the current prefill covers
        self.admit_seq = -1  # admission order: lower = admitted earlier (protected first)
        self.admit_time = 0.0
        self.num_preemptions = 0
        self.drafter_lag = 0  # tokens committed since the drafter last saw this request
        self.last_mode = Mode.AR
        self.mode_since_round = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_token_ids)

    @property
    def context_len(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens this request may still emit before max_tokens."""
        return self.spec.max_tokens - len(self.output_token_ids)

    def context_token_ids(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def is_live(self) -> bool:
        return self.state in (ReqState.PREFILLING, ReqState.DECODING)

    @property
    def is_done(self) -> bool:
        return self.state in (ReqState.FINISHED, ReqState.ABORTED)
