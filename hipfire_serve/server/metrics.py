"""Prometheus metrics at `/metrics`, following vLLM's schema under the `hipfire:` prefix.

Dashboards and routers built for vLLM read the same names after a prefix swap; with
`--metrics-compat vllm` the vLLM-named twins are exported too (plus the legacy
`vllm:gpu_cache_usage_perc`). The scheduler's own metrics (rows, routes, phases, predicted vs
measured round time, policy switches, slots) have no vLLM counterpart and stay `hipfire:` only.

Labels: `model_name` everywhere; `tenant` on per-request and prefix-cache counters only with
`--metrics-tenant-labels`: `/metrics` takes no API key, so the label would show every tenant's
name and traffic to anyone who reaches the port (tenants come from a file, so the label stays
low-cardinality when on). The twins of the prefix-cache counters and of `cache_config_info`
carry vLLM's labels exactly, its `engine` too. Metrics labelled by `model_name` alone exist from
start-up (gauges at 0), so scrapes and `rate()` see them before the first request. Updates come
from the event-loop thread only (one batch per engine round), so rounds do not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

PREFIX = "hipfire:"

# Buckets as vLLM uses them, so dashboards' quantile panels line up.
# fmt: off
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
_ROUND_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2,
    0.5, 1.0, 2.0,
)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_SPEC_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# fmt: on

_M = ("model_name",)
_MT = ("model_name", "tenant")

# vLLM's `engine` label is the index of the engine core behind the API server; a server here
# drives one engine.
VLLM_ENGINE = "0"
# `cache_config_info`'s labels: the fields of vLLM's CacheConfig this server can fill truthfully.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `kind(PREFIX + name, help, labels)`, held on `ServerMetrics` under its name
    without the `_seconds` unit (`time_to_first_token_seconds` -> `.time_to_first_token`)."""

    kind: type  # Counter | Gauge | Histogram
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # Histogram only
    in_vllm: bool = False  # vLLM's schema has it: exported as `vllm:<name>` with vllm_compat
    vllm_aliases: tuple[str, ...] = ()  # further `vllm:` names of it (legacy ones)
    vllm_engine: bool = False  # the twin carries vLLM's `engine` label (`VLLM_ENGINE`)

    @property
    def attr(self) -> str:
        return self.name.removesuffix("_seconds")


# In registration order, which is the order of /metrics.
METRICS = (
    # engine state
    MetricSpec(
        Gauge,
        "num_requests_running",
        "Requests holding a slot (decoding or prefilling).",
        _M,
        in_vllm=True,
    ),
    MetricSpec(Gauge, "num_requests_waiting", "Requests waiting for a slot.", _M, in_vllm=True),
    MetricSpec(
        Gauge,
        "kv_cache_usage_perc",
        "KV cache usage, 1 means full.",
        _M,
        in_vllm=True,
        vllm_aliases=("gpu_cache_usage_perc",),
    ),
    MetricSpec(Gauge, "live_slots", "Slots in use.", _M),
    MetricSpec(Gauge, "slot_capacity", "Slot pool size.", _M),
    # prefix caching, in context tokens at admission. vLLM v1 records a preempted request's
    # new lookup apart (PrefixCacheStats.preempted_*) and exports only the others as
    # vllm:prefix_cache_queries/hits, so a request finding its own blocks again does not raise
    # the hit rate. So do these; the resumed lookups have hipfire-only counters of their own.
    MetricSpec(
        Counter,
        "prefix_cache_queries",
        "Prefix cache queries: context tokens looked up at admission.",
        _MT,
        in_vllm=True,
        vllm_engine=True,
    ),
    MetricSpec(
        Counter,
        "prefix_cache_hits",
        "Prefix cache hits: context tokens found cached at admission.",
        _MT,
        in_vllm=True,
        vllm_engine=True,
    ),
    MetricSpec(
        Counter,
        "prefix_cache_resumed_queries",
        "Context tokens looked up by requests resumed after preemption.",
        _M,
    ),
    MetricSpec(
        Counter,
        "prefix_cache_resumed_hits",
        "Context tokens found cached by requests resumed after preemption.",
        _M,
    ),
    # per request
    MetricSpec(
        Histogram,
        "time_to_first_token_seconds",
        "Arrival to first generated token.",
        _MT,
        _TTFT_BUCKETS,
        in_vllm=True,
    ),
    MetricSpec(
        Histogram,
        "inter_token_latency_seconds",
        "Time between consecutive output tokens.",
        _MT,
        _ITL_BUCKETS,
        in_vllm=True,
    ),
    MetricSpec(
        Histogram,
        "time_per_output_token_seconds",
        "Per request: (e2e - time to first token) / (output tokens - 1).",
        _MT,
        _ITL_BUCKETS,
        in_vllm=True,
    ),
    MetricSpec(
        Histogram,
        "e2e_request_latency_seconds",
        "Arrival to last token.",
        _MT,
        _REQUEST_BUCKETS,
        in_vllm=True,
    ),
    MetricSpec(
        Histogram,
        "request_queue_time_seconds",
        "Arrival until the engine took the request in (server queue and admission).",
        _MT,
        _REQUEST_BUCKETS,
        in_vllm=True,
    ),
    MetricSpec(Counter, "prompt_tokens", "Prompt tokens of admitted requests.", _MT, in_vllm=True),
    MetricSpec(Counter, "generation_tokens", "Generated tokens.", _MT, in_vllm=True),
    MetricSpec(
        Counter,
        "request_success",
        "Finished requests by finish reason.",
        (*_MT, "finished_reason"),
        in_vllm=True,
    ),
    # speculative decoding
    MetricSpec(
        Counter,
        "spec_decode_num_drafts",
        "Speculative steps (one per speculating request and round).",
        _M,
        in_vllm=True,
    ),
    MetricSpec(Counter, "spec_decode_num_draft_tokens", "Drafted tokens.", _M, in_vllm=True),
    MetricSpec(
        Counter, "spec_decode_num_accepted_tokens", "Accepted drafted tokens.", _M, in_vllm=True
    ),
    MetricSpec(
        Counter,
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted drafted tokens by draft position (0 is the first drafted token).",
        (*_M, "position"),
        in_vllm=True,
    ),
    # the scheduler's own
    MetricSpec(Histogram, "round_rows", "Rows verified in one target forward.", _M, _ROW_BUCKETS),
    MetricSpec(
        Histogram, "round_spec_requests", "Speculating requests per round.", _M, _SPEC_BUCKETS
    ),
    MetricSpec(
        Counter,
        "round_route",
        "Requests per route (spec, ar, prefill), summed over rounds.",
        (*_M, "route"),
    ),
    MetricSpec(
        Histogram,
        "round_duration_seconds",
        "Round phase durations.",
        (*_M, "phase"),
        _ROUND_BUCKETS,
    ),
    MetricSpec(
        Histogram,
        "round_predicted_seconds",
        "Round time the cost model predicted.",
        _M,
        _ROUND_BUCKETS,
    ),
    MetricSpec(Histogram, "round_measured_seconds", "Round time measured.", _M, _ROUND_BUCKETS),
    MetricSpec(Counter, "policy_switches", "Times the speculation policy changed its route.", _M),
    MetricSpec(
        Counter,
        "rounds_overlapped",
        "Rounds whose successor was launched before they finished (rounds ahead).",
        _M,
    ),
)

ROUTES = ("spec", "ar", "prefill")


class ServerMetrics:
    """All metric objects of one server, in their own registry (tests run several servers
    in one process); each `METRICS` entry is an attribute (`MetricSpec.attr`)."""

    def __init__(
        self, model_name: str, *, vllm_compat: bool = False, tenant_labels: bool = False
    ) -> None:
        self.model_name = model_name
        self.tenant_labels = tenant_labels
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple, Any] = {}
        for spec in METRICS:
            extra = {} if spec.buckets is None else {"buckets": spec.buckets}
            labels = (
                spec.labels if tenant_labels else tuple(n for n in spec.labels if n != "tenant")
            )
            metric = spec.kind(
                PREFIX + spec.name, spec.help, labels, registry=self.registry, **extra
            )
            setattr(self, spec.attr, metric)
            if labels == _M:
                self._c(metric, model_name)  # exported from start-up, at 0
        # An info metric as vLLM makes it: a gauge at 1 whose labels say the configuration. Not
        # in METRICS: it has no series of `model_name` alone, and its labels are known once
        # the engine reports (its first stats come as it starts).
        self.cache_config_info = Gauge(
            PREFIX + "cache_config_info",
            "The KV cache's configuration, in the labels (the value is 1).",
            (*_M, *CACHE_CONFIG_LABELS),
            registry=self.registry,
        )
        self._cache_config: tuple[str, ...] = ()
        self._prefix_totals: dict[tuple[str, str | None], int] = {}
        if vllm_compat:
            sources = [
                (
                    getattr(self, s.attr),
                    (s.name, *s.vllm_aliases),
                    _with_engine if s.vllm_engine else None,
                )
                for s in METRICS
                if s.in_vllm
            ]
            sources.append((self.cache_config_info, ("cache_config_info",), _vllm_info_labels))
            self.registry.register(_VllmAliases(sources))

    def _c(self, metric: Any, *labels: str) -> Any:
        """The metric's child for `labels`, cached: `.labels()` validates on every call, and
        these updates run for every round and every streamed delta."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # --- updates (event-loop thread) ---

    def observe_engine(self, stats: Any) -> None:
        """One `Engine.stats()` snapshot: gauges, and the rounds it drained."""
        name = self.model_name
        self._c(self.num_requests_running, name).set(stats.num_running)
        self._c(self.num_requests_waiting, name).set(stats.num_waiting)
        self._c(self.kv_cache_usage_perc, name).set(stats.kv_usage)
        self._c(self.live_slots, name).set(stats.live_slots)
        self._c(self.slot_capacity, name).set(stats.slot_capacity)
        # Only `ServedStats` (server/engine_client.py) has these; stats made up after an
        # engine failure do not, and leave them as they are.
        if getattr(stats, "block_size", 0):
            self._observe_cache_config(stats)
            self._observe_prefix_cache(stats)
        for rnd in stats.rounds:
            self.observe_round(rnd)

    def _observe_cache_config(self, stats: Any) -> None:
        # The KV cache takes the model's dtype, which vLLM's cache_dtype calls "auto".
        enabled = str(bool(stats.enable_prefix_caching))  # vLLM's spelling: True / False
        config = (str(stats.block_size), str(stats.num_kv_blocks), enabled, "auto")
        if config != self._cache_config:
            self.cache_config_info.clear()
            self.cache_config_info.labels(self.model_name, *config).set(1)
            self._cache_config = config

    def _observe_prefix_cache(self, stats: Any) -> None:
        """Advances the prefix-cache counters by what the engine's totals grew since its last
        stats. A total below the one seen before means a fresh engine (a restarted child),
        whose totals count from 0: all of them are new."""
        totals: dict[tuple[str, str | None], int] = {}
        for attr in ("prefix_cache_queries", "prefix_cache_hits"):
            for tenant, num_tokens in getattr(stats, attr).items():
                totals[(attr, tenant)] = num_tokens
        totals[("prefix_cache_resumed_queries", None)] = stats.prefix_cache_resumed_queries
        totals[("prefix_cache_resumed_hits", None)] = stats.prefix_cache_resumed_hits
        seen = self._prefix_totals
        if any(totals.get(key, 0) < num_tokens for key, num_tokens in seen.items()):
            seen = {}
        for (attr, tenant), num_tokens in totals.items():
            grown = num_tokens - seen.get((attr, tenant), 0)
            if grown:
                labels = (self.model_name,) if tenant is None else self._labels(tenant)
                self._c(getattr(self, attr), *labels).inc(grown)
        self._prefix_totals = totals

    def observe_round(self, rnd: Any) -> None:
        name = self.model_name
        self._c(self.round_rows, name).observe(rnd.num_rows)
        self._c(self.round_spec_requests, name).observe(rnd.num_spec)
        for route, count in zip(ROUTES, (rnd.num_spec, rnd.num_ar, rnd.num_prefill)):
            if count:
                self._c(self.round_route, name, route).inc(count)
        for phase, seconds in rnd.phase_s.items():
            self._c(self.round_duration, name, phase).observe(seconds)
        self._c(self.round_predicted, name).observe(rnd.predicted_s)
        self._c(self.round_measured, name).observe(rnd.measured_s)
        if rnd.policy_switches:
            self._c(self.policy_switches, name).inc(rnd.policy_switches)
        if getattr(rnd, "overlapped", False):
            self._c(self.rounds_overlapped, name).inc()
        if rnd.num_spec:
            self._c(self.spec_decode_num_drafts, name).inc(rnd.num_spec)
        drafted = sum(rnd.drafted_per_pos)
        accepted = sum(rnd.accepted_per_pos)
        if drafted:
            self._c(self.spec_decode_num_draft_tokens, name).inc(drafted)
        if accepted:
            self._c(self.spec_decode_num_accepted_tokens, name).inc(accepted)
        for pos, count in enumerate(rnd.accepted_per_pos):
            if count:
                self._c(self.spec_decode_num_accepted_tokens_per_pos, name, str(pos)).inc(count)

    def _labels(self, tenant: str) -> tuple[str, ...]:
        return (self.model_name, tenant) if self.tenant_labels else (self.model_name,)

    def request_admitted(self, tenant: str, num_prompt_tokens: int, queue_s: float) -> None:
        labels = self._labels(tenant)
        self._c(self.prompt_tokens, *labels).inc(num_prompt_tokens)
        self._c(self.request_queue_time, *labels).observe(queue_s)

    def first_token(self, tenant: str, ttft_s: float) -> None:
        self._c(self.time_to_first_token, *self._labels(tenant)).observe(ttft_s)

    def tokens_generated(self, tenant: str, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` arrived together `gap_s` after the previous ones (None: the first)."""
        labels = self._labels(tenant)
        self._c(self.generation_tokens, *labels).inc(num_tokens)
        if gap_s is not None and num_tokens > 0:
            # Speculation delivers several tokens at once: each counts gap / num_tokens.
            itl = self._c(self.inter_token_latency, *labels)
            per_token = gap_s / num_tokens
            for _ in range(num_tokens):
                itl.observe(per_token)

    def request_finished(
        self,
        tenant: str,
        finish_reason: str,
        *,
        e2e_s: float,
        ttft_s: float | None,
        num_output_tokens: int,
    ) -> None:
        labels = self._labels(tenant)
        self._c(self.request_success, *labels, finish_reason).inc()
        self._c(self.e2e_request_latency, *labels).observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            tpot = (e2e_s - ttft_s) / (num_output_tokens - 1)
            self._c(self.time_per_output_token, *labels).observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


Relabel = Callable[[dict[str, str]], dict[str, str]]


class _VllmAliases:
    """Re-exports the vLLM-schema metrics under `vllm:` names at scrape time (no second set
    of objects to keep in step): each source is a metric, its names without `vllm:`, and how
    its labels become vLLM's (None: as they are)."""

    def __init__(self, sources: list[tuple[Any, tuple[str, ...], Relabel | None]]) -> None:
        self.sources = sources

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        for metric, names, relabel in self.sources:
            for family in metric.collect():
                for name in names:
                    yield _renamed(family, family.name, "vllm:" + name, relabel)


def _with_engine(labels: dict[str, str]) -> dict[str, str]:
    return {"model_name": labels["model_name"], "engine": VLLM_ENGINE, **labels}


def _vllm_info_labels(labels: dict[str, str]) -> dict[str, str]:
    """vLLM's cache_config_info has the config's labels and `engine`, no `model_name`."""
    return {**{n: labels[n] for n in CACHE_CONFIG_LABELS}, "engine": VLLM_ENGINE}


def _renamed(family: Metric, old: str, new: str, relabel: Relabel | None = None) -> Metric:
    out = Metric(new, family.documentation, family.type, family.unit)
    out.samples = [
        s._replace(
            name=new + s.name[len(old) :],
            labels=s.labels if relabel is None else relabel(s.labels),
        )
        for s in family.samples
    ]
    return out
