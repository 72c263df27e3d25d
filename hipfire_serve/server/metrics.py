"""Prometheus metrics at `/metrics`, following vLLM's schema under the `hipfire:` prefix.

Dashboards and routers built for vLLM read the same names after a prefix swap; with
`--metrics-compat vllm` the vLLM-named twins are exported too (plus the legacy
`vllm:gpu_cache_usage_perc`). The scheduler's own metrics (rows, routes, phases, predicted vs
measured round time, policy switches, slots) have no vLLM counterpart and stay `hipfire:` only.

Labels: `model_name` everywhere; `tenant` on per-request metrics (tenants come from a file, so
the label stays low-cardinality). Updates come from the event-loop thread only (one batch per
engine round), never from the engine thread, so rounds do not pay for them.
"""

from __future__ import annotations

from collections.abc import Iterable
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

# Metrics that exist in vLLM's schema (hipfire name -> extra vLLM aliases beyond the prefix).
VLLM_NAMES = {
    "num_requests_running": (),
    "num_requests_waiting": (),
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "time_to_first_token_seconds": (),
    "inter_token_latency_seconds": (),
    "time_per_output_token_seconds": (),
    "e2e_request_latency_seconds": (),
    "request_queue_time_seconds": (),
    "prompt_tokens": (),
    "generation_tokens": (),
    "request_success": (),
    "spec_decode_num_drafts": (),
    "spec_decode_num_draft_tokens": (),
    "spec_decode_num_accepted_tokens": (),
    "spec_decode_num_accepted_tokens_per_pos": (),
}

ROUTES = ("spec", "ar", "prefill")


class ServerMetrics:
    """All metric objects of one server, in their own registry (tests run several servers
    in one process)."""

    def __init__(self, model_name: str, *, vllm_compat: bool = False) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple, Any] = {}
        r = self.registry
        m = ("model_name",)
        mt = ("model_name", "tenant")
        p = PREFIX
        # engine state
        self.num_requests_running = Gauge(
            p + "num_requests_running",
            "Requests holding a slot (decoding or prefilling).",
            m,
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            p + "num_requests_waiting", "Requests waiting for a slot.", m, registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            p + "kv_cache_usage_perc", "KV cache usage, 1 means full.", m, registry=r
        )
        self.live_slots = Gauge(p + "live_slots", "Slots in use.", m, registry=r)
        self.slot_capacity = Gauge(p + "slot_capacity", "Slot pool size.", m, registry=r)
        # per request
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            mt,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            p + "inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            mt,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            p + "time_per_output_token_seconds",
            "Per request: (e2e - time to first token) / (output tokens - 1).",
            mt,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to last token.",
            mt,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival until the engine took the request in (server queue and admission).",
            mt,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of admitted requests.", mt, registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Generated tokens.", mt, registry=r
        )
        self.request_success = Counter(
            p + "request_success",
            "Finished requests by finish reason.",
            (*mt, "finished_reason"),
            registry=r,
        )
        # speculative decoding
        self.spec_decode_num_drafts = Counter(
            p + "spec_decode_num_drafts",
            "Speculative steps (one per speculating request and round).",
            m,
            registry=r,
        )
        self.spec_decode_num_draft_tokens = Counter(
            p + "spec_decode_num_draft_tokens", "Drafted tokens.", m, registry=r
        )
        self.spec_decode_num_accepted_tokens = Counter(
            p + "spec_decode_num_accepted_tokens", "Accepted drafted tokens.", m, registry=r
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by draft position (0 is the first drafted token).",
            (*m, "position"),
            registry=r,
        )
        # the scheduler's own
        self.round_rows = Histogram(
            p + "round_rows",
            "Rows verified in one target forward.",
            m,
            buckets=_ROW_BUCKETS,
            registry=r,
        )
        self.round_spec_requests = Histogram(
            p + "round_spec_requests",
            "Speculating requests per round.",
            m,
            buckets=_SPEC_BUCKETS,
            registry=r,
        )
        self.round_route = Counter(
            p + "round_route",
            "Requests per route (spec, ar, prefill), summed over rounds.",
            (*m, "route"),
            registry=r,
        )
        self.round_duration = Histogram(
            p + "round_duration_seconds",
            "Round phase durations.",
            (*m, "phase"),
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        self.round_predicted = Histogram(
            p + "round_predicted_seconds",
            "Round time the cost model predicted.",
            m,
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        self.round_measured = Histogram(
            p + "round_measured_seconds",
            "Round time measured.",
            m,
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        self.policy_switches = Counter(
            p + "policy_switches", "Times the speculation policy changed its route.", m, registry=r
        )
        self.rounds_overlapped = Counter(
            p + "rounds_overlapped",
            "Rounds whose successor was launched before they finished (rounds ahead).",
            m,
            registry=r,
        )
        if vllm_compat:
            vllm_sources = [getattr(self, attr) for attr in _ATTR_OF_VLLM_NAME.values()]
            self.registry.register(_VllmAliases(vllm_sources))

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
        for rnd in stats.rounds:
            self.observe_round(rnd)

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

    def request_admitted(self, tenant: str, num_prompt_tokens: int, queue_s: float) -> None:
        labels = (self.model_name, tenant)
        self._c(self.prompt_tokens, *labels).inc(num_prompt_tokens)
        self._c(self.request_queue_time, *labels).observe(queue_s)

    def first_token(self, tenant: str, ttft_s: float) -> None:
        self._c(self.time_to_first_token, self.model_name, tenant).observe(ttft_s)

    def tokens_generated(self, tenant: str, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` arrived together `gap_s` after the previous ones (None: the first)."""
        labels = (self.model_name, tenant)
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
        labels = (self.model_name, tenant)
        self._c(self.request_success, *labels, finish_reason).inc()
        self._c(self.e2e_request_latency, *labels).observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            tpot = (e2e_s - ttft_s) / (num_output_tokens - 1)
            self._c(self.time_per_output_token, *labels).observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# vLLM-schema name -> ServerMetrics attribute holding it.
_ATTR_OF_VLLM_NAME = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "time_to_first_token_seconds": "time_to_first_token",
    "inter_token_latency_seconds": "inter_token_latency",
    "time_per_output_token_seconds": "time_per_output_token",
    "e2e_request_latency_seconds": "e2e_request_latency",
    "request_queue_time_seconds": "request_queue_time",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "spec_decode_num_accepted_tokens_per_pos",
}


class _VllmAliases:
    """Re-exports the vLLM-schema metrics under `vllm:` names at scrape time (no second set
    of objects to keep in step)."""

    def __init__(self, sources: list[Any]) -> None:
        self.sources = sources

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        for source in self.sources:
            for family in source.collect():
                base = family.name[len(PREFIX) :]
                for alias in (base, *VLLM_NAMES[base]):
                    yield _renamed(family, family.name, "vllm:" + alias)


def _renamed(family: Metric, old: str, new: str) -> Metric:
    out = Metric(new, family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=new + s.name[len(old) :]) for s in family.samples]
    return out
