"""The scheduler's configuration: one frozen dataclass whose field docs make the CLI's help."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.policy import HYSTERESIS, MIN_DWELL_ROUNDS

FOLLOW_MODES = ("off", "on", "auto")  # SchedulerConfig.drafter_follows_prefill


def _f(default, help_: str):
    return field(default=default, metadata={"help": help_})


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_concurrency: int = _f(64, "live slot capacity")
    max_queue: int = _f(1024, "waiting requests beyond which add_request raises QueueFullError")
    spec_mode: str = _f("adaptive", "adaptive | spec | ar")
    spec_depth: int = _f(8, "rows per speculating request at most (drafts + 1)")
    block_size: int = _f(16, "tokens per KV block")
    max_prefill_tokens: int = _f(
        2048,
        "prefill rows per round (chunked prefill budget; a prompt's rest of 1/8 of it goes along)",
    )
    max_model_len: int = _f(0, "prompt + max_tokens limit; 0: only the KV capacity limits")
    has_drafter: bool = _f(True, "a drafter is loaded; without one no round speculates")
    draft_kv_lookahead: int = _f(
        0,
        "KV positions past its AR row that a speculating request's drafter writes, whatever "
        "its depth (a block drafter's whole block); blocks for them are held for the round",
    )
    drafter_follows_prefill: str = _f(
        "off",
        "whether the drafter computes prefill chunks alongside the target (a draft model; "
        "otherwise it catches up on the whole context at a request's first SPEC round): off, "
        "on, or auto (prompts whose following the policy's speculation on the live batch, "
        "every request decoding with its drafter caught up, would pay back)",
    )
    enable_prefix_caching: bool = _f(
        True,
        "reuse the KV of cached full blocks of a context's prefix (content-addressed, shared "
        "read-only, evicted LRU when unreferenced); prefill starts after the cached prefix",
    )
    shared_prefix_cache: bool = _f(
        False,
        "one prefix cache for all tenants; otherwise a tenant only reuses blocks its own "
        "requests made (requests' cache_salt still separates either way)",
    )
    prior_acceptance: float = _f(0.7, "drafter acceptance assumed before any observation")
    kv_watermark: float = _f(
        0.01, "fraction of KV blocks kept free at admission, headroom for decode growth"
    )
    hysteresis: float = _f(HYSTERESIS, "relative estimate margin needed to switch a request")
    min_dwell_rounds: int = _f(MIN_DWELL_ROUNDS, "rounds a request keeps a new mode")

    def validate(self) -> None:
        if self.spec_mode not in ("adaptive", "spec", "ar"):
            raise ValueError(f"spec_mode must be adaptive, spec or ar, got {self.spec_mode!r}")
        if self.max_concurrency < 1 or self.spec_depth < 1 or self.block_size < 1:
            raise ValueError("max_concurrency, spec_depth and block_size must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.drafter_follows_prefill not in FOLLOW_MODES:
            raise ValueError(
                f"drafter_follows_prefill must be one of {', '.join(FOLLOW_MODES)}, got "
                f"{self.drafter_follows_prefill!r}"
            )

    @property
    def max_drafts(self) -> int:
        return self.spec_depth - 1 if self.has_drafter and self.spec_mode != "ar" else 0
