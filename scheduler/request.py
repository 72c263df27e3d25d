"""Requests as the scheduler sees them: what the engine submits, what a round gives back, and the
mutable per-request state the scheduler keeps between rounds."""

from __future__ import annotations

import enum

import msgspec
import numpy as np

from scheduler.plan import Mode, SamplingSpec, TokenLogprob, frozen_array, offsets

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
    # requests share cached KV blocks only with equal salts (and tenants, unless the cache is
    # shared): vLLM's field, for isolation finer than the tenant's
    cache_salt: str | None = None


class RequestDelta(msgspec.Struct, frozen=True, kw_only=True):
    """What one round added to one request, after stop truncation."""

    req_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None = None  # token id or stop string
    num_drafted: int = 0  # this round
    num_accepted: int = 0


class RoundDeltas(msgspec.Struct, frozen=True, kw_only=True):
    """What one round added to its requests, after stop truncation, as read-only int64 columns
    (one row per request that got a delta, in the plan's row order). Row i kept
    `token_ids[token_starts[i]:token_starts[i + 1]]`. Finishes and logprobs are sparse: only
    the rows that have one. Iterating gives `RequestDelta` objects (tests and slow paths)."""

    req_ids: np.ndarray  # [m]
    token_starts: np.ndarray  # [m + 1]
    token_ids: np.ndarray  # [token_starts[-1]]
    num_drafted: np.ndarray  # [m] this round
    num_accepted: np.ndarray  # [m]
    finish: dict[int, tuple[str, int | str | None]] = msgspec.field(default_factory=dict)
    logprobs: dict[int, tuple[TokenLogprob, ...]] = msgspec.field(default_factory=dict)

    @classmethod
    def build(
        cls, req_ids, num_kept, token_ids, num_drafted, num_accepted, finish=None, logprobs=None
    ) -> RoundDeltas:
        return cls(
            req_ids=frozen_array(req_ids),
            token_starts=frozen_array(offsets(np.asarray(num_kept, dtype=np.int64))),
            token_ids=frozen_array(token_ids),
            num_drafted=frozen_array(num_drafted),
            num_accepted=frozen_array(num_accepted),
            finish=finish or {},
            logprobs=logprobs or {},
        )

    @classmethod
    def empty(cls) -> RoundDeltas:
        return cls.build((), (), (), (), ())

    def __len__(self) -> int:
        return len(self.req_ids)

    def delta(self, i: int) -> RequestDelta:
        a, b = int(self.token_starts[i]), int(self.token_starts[i + 1])
        finish, stop_reason = self.finish.get(i, (None, None))
        return RequestDelta(
            req_id=int(self.req_ids[i]),
            token_ids=tuple(int(t) for t in self.token_ids[a:b]),
            logprobs=self.logprobs.get(i),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_drafted=int(self.num_drafted[i]),
            num_accepted=int(self.num_accepted[i]),
        )

    def __iter__(self):
        return (self.delta(i) for i in range(len(self.req_ids)))


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
        "cache_keys",
        "drafter_followed",
        "drafter_lag",
        "finish_reason",
        "last_mode",
        "mode_since_round",
        "num_accepted",
        "num_cached_blocks",
        "num_cached_tokens",
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
        self.cache_keys: list[bytes] = []  # prefix-cache keys of the context's full blocks
        # blocks at the head of its table already offered to the prefix cache (found there at
        # admission, or registered once committed)
        self.num_cached_blocks = 0
        self.num_cached_tokens = 0  # positions its prefill started from (a prefix-cache hit)
        self.admit_seq = -1  # admission order: lower = admitted earlier (protected first)
        self.admit_time = 0.0
        self.num_preemptions = 0
        self.drafter_lag = 0  # tokens committed since the drafter last saw this request
        self.drafter_followed = 0  # prompt tokens whose draft KV the drafter computed in prefill
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
